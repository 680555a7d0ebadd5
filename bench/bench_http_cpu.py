"""The HTTP process's CPU per streamed token, two checkouts side by side: for a change on the HTTP
side (docs/api-servers.md, "The HTTP side's cost per token").

    git worktree add --detach /tmp/old <commit>
    .venv/bin/python -m bench.bench_http_cpu /tmp/old . --small --rounds 8

One server from each checkout (`python -m service`, run in that folder), both up at once, the
same clients (bench_serve's) driving them in turn, the order alternating each round, so a change
in the machine's load hits both alike. Printed per round: each one's HTTP-process CPU ms per
token, and new / old. --small serves a 4-layer 256-wide random model (the engine's step is
short, so the HTTP side's share of the machine is larger) with GPT-2's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from bench.serve_clients import Server, drive_clients, prompt_texts, serve_clients
from bench.common import write_random_model
from model.config import GPT2Config

SMALL = GPT2Config(vocab_size=50257, n_positions=256, n_embd=256, n_layer=4, n_head=4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="a checkout (git worktree) of the code before the change")
    parser.add_argument("new", type=Path, help="a checkout of the code after it")
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--small", action="store_true", help="serve a 4-layer 256-wide random model instead")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine core")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.set_defaults(device="cpu", dtype="float32", api_servers=[1])  # what Server reads of bench_serve's flags
    args = parser.parse_args(argv)
    args.model_dir = args.model_dir.resolve()  # the servers run in the checkouts' folders
    return args


def compare(args: argparse.Namespace) -> None:
    servers = {checkout: Server(args, args.clients, checkout=checkout) for checkout in (args.old, args.new)}
    texts = prompt_texts(max(args.clients, 17), 8)
    http_ms: dict[Path, list[float]] = {args.old: [], args.new: []}
    try:
        for server in servers.values():
            server.wait_ready()
            asyncio.run(drive_clients(server.url, texts, 1, 1, 4))  # first-request costs are not per token
        for round_ in range(args.rounds):
            for checkout in (args.old, args.new) if round_ % 2 == 0 else (args.new, args.old):
                stats = serve_clients(servers[checkout], texts, args.clients, args.requests_per_client, args.new_tokens)
                http_ms[checkout].append(stats.cpu_ms_per_token("http"))
            old, new = http_ms[args.old][-1], http_ms[args.new][-1]
            print(f"round {round_}: HTTP CPU ms per token, old {old:.4f}, new {new:.4f}, new / old {ratio(new, old)}",
                  flush=True)
    finally:
        for server in servers.values():
            server.stop()
    ratios = [n / o for o, n in zip(http_ms[args.old], http_ms[args.new]) if o]
    median = f"{statistics.median(ratios):.3f}" if ratios else "-"
    print(f"new / old: median {median}, of the means "
          f"{ratio(statistics.mean(http_ms[args.new]), statistics.mean(http_ms[args.old]))} ({args.rounds} rounds)")


def ratio(new: float, old: float) -> str:
    """A round too short for one clock tick of the HTTP process's CPU time reads 0: no ratio."""
    return f"{new / old:.3f}" if old else "-"


def main() -> None:
    args = parse_args()
    if not args.small:
        compare(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = write_random_model(Path(tmp), SMALL)
        compare(args)


if __name__ == "__main__":
    main()
