"""bench_serve --against CHECKOUT: this checkout's server ("new") and one run from another git
worktree ("old"), with the same flags, both up at once, alternating round by round (a change in
the machine's load hits both alike). bench/bench_serve.py's docstring says what is printed."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
from pathlib import Path

from bench.common import describe_machine
from bench.serve_clients import Server, drive_clients, serve_clients


def compare_checkouts(args: argparse.Namespace, texts: list[str]) -> None:
    """--against: new/old tok/s per client count, the two servers alternating round by round."""
    checkouts = {"old": args.against, "new": None}  # None: this one
    servers: dict[str, Server] = {}
    rates: dict[tuple[str, int], list[float]] = {}
    sampled = args.top_p is not None  # bench_serve's --top-p: every request samples
    print(describe_machine(), flush=True)
    print(f"old: {describe_checkout(args.against)}; new: {describe_checkout(Path(__file__).resolve().parents[1])}; "
          f"{args.model_dir}, {args.device} {args.dtype}, {args.new_tokens} new tokens per request, "
          f"{args.requests_per_client} request(s) per client"
          + (f", sampled with top_p {args.top_p}" if sampled else ", greedy"), flush=True)
    try:
        for name, checkout in checkouts.items():
            # One at a time, and given minutes: on the busy 2-core machine one 124M server took 80-120 s
            # to answer, two starting at once longer.
            servers[name] = Server(args, max(args.clients), args.quantize[0], args.api_servers[0], checkout=checkout,
                                   stream_interval=args.stream_interval, prefix_caching=args.prefix_caching)
            servers[name].wait_ready(timeout=600)
        for server in servers.values():
            for clients in args.clients:  # first-request costs and each batch shape's first kernels
                asyncio.run(drive_clients(server.url, texts, clients, 1, 4))
        for round_ in range(args.rounds):
            order = alternating(list(servers), round_)
            for clients in args.clients:
                for name in order:
                    stats = serve_clients(servers[name], texts, clients, args.requests_per_client, args.new_tokens,
                                          {"do_sample": True, "top_p": args.top_p} if sampled else None,
                                          processes=args.client_processes)
                    rates.setdefault((name, clients), []).append(stats.tokens / stats.seconds)
                old, new = rates["old", clients][-1], rates["new", clients][-1]
                print(f"round {round_} ({order[0]} first) {clients:4d} clients: old {old:8.1f} tok/s, new {new:8.1f} tok/s,"
                      f" new/old {new / old:.3f}x", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\nmedians over {args.rounds} rounds")
    print(f"{'clients':>7s} {'old tok/s':>10s} {'new tok/s':>10s} {'new/old':>8s}  rounds' new/old")
    for clients in args.clients:
        old, new = rates["old", clients], rates["new", clients]
        ratios = [n / o for o, n in zip(old, new)]
        print(f"{clients:7d} {statistics.median(old):10.1f} {statistics.median(new):10.1f} {statistics.median(ratios):7.3f}x"
              f"  {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"\n{describe_machine()}")


def alternating(names: list[str], round_: int) -> list[str]:
    """Who serves first in this round: the given order in even rounds, reversed in odd ones."""
    return names if round_ % 2 == 0 else names[::-1]


def describe_checkout(path: Path) -> str:
    """The folder and its commit (and whether its files differ from it), as git tells."""
    def git(*command: str) -> str:
        done = subprocess.run(["git", "-C", str(path), *command], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else "?"

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{path} at {git('log', '-1', '--format=%h')}{' with uncommitted changes' if dirty else ''}"
