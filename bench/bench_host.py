"""The host's cost of serving, with the device's work taken out: the loop to iterate on without a GPU.

    .venv/bin/python -m bench.bench_host                                  # this checkout
    git worktree add --detach /tmp/old <commit>
    .venv/bin/python -m bench.bench_host --against /tmp/old --rounds 3    # before vs after, same run

The real server (`python -m service`: HTTP process, engine core process, analysis process) runs
through bench/host_standin.py, which replaces the model's forwards and the sampler's draw with
stand-ins of negligible cost in the engine core; its docstring says exactly what that leaves out
(kernel launches, device waits, every vocabulary-wide tensor). Everything else is the product's
own code path. C streaming clients (`/generate_stream`, greedy, ignore_eos, prompts of different
lengths, on raw connections that count events: cheap enough for one process to keep 256 busy) each run --requests-per-stream requests of --new-tokens tokens.

Printed per stream count and checkout, from the processes' own CPU time (/proc: robust to the
machine being shared with the clients, unlike wall time) and the server's /metrics:
- core µs per row-step: the engine core's CPU time over the rows it stepped (tokens computed);
- core ms per step (host only: the stand-in device's sleep is not CPU time), and rows per step
  (how full the batch ran: the device's pace, --device-ms, decides how much streams overlap);
- HTTP µs per token: the HTTP process's CPU time over the tokens the clients received;
- ITL p50/p99: the gaps between tokens as the clients read them (events in one read: 0), the
  stand-in's view of the issue's "inter-token p99 at most 2x its p50" (the device's pace is a
  steady sleep here, so what spreads the gaps is the host's work: admissions, prefills, bursts).
The issue's goals: at most 10 µs per row-step at 256 streams, 30 µs HTTP CPU per token at 64.

`--api-servers N` runs each server with N HTTP processes (their CPU summed with the supervisor's)
and tok/s, the tokens the clients received per second of wall time, says whether they keep up
with the stand-in device (at most streams / --device-ms). On a many-core host (a GPU machine's,
say) that answers whether N HTTP processes deliver what the device produces at 256 streams,
without the device.

`--flags "..."` serves this checkout with those server flags added (`--flags="--stream-interval
4"`, `--flags=--no-access-log`); without --against the reference ("old") is this checkout without
them, so the ratio is the flags' own effect on the same code.

`--gc-log PATH`: every server process times its garbage collections (PATH.new.http.json, ...:
counts, seconds, each full collection's pause).

`--profile PATH`: this checkout's engine core and HTTP process run under cProfile with the CPU
clock (PATH.core, PATH.http; read with `python -m pstats`). It slows both several times: read
call counts and shares from it, never the timings printed beside it.

`--core-only`: the engine core alone in one process per checkout (bench/host_core.py: no HTTP, no
IPC, no device pacing, N requests always running and replaced as they end), its CPU time per
row-step at each --streams count as the number running: a steadier figure for the core's own
bookkeeping, where a server's depends on how full its clients keep the batch.
`--core-only --mix SPEC [--each]`: the core alone under mixed load (bench/host_core.py --mix:
`all`, or `grammar=1/16,beam=1/64,ngram=1/16,top_logprobs=1/16,stop_ids=1/16,lora=1/16`): per
checkout and round, host µs per row-step of the plain batch and of the mix (with --each, of every
feature alone too) in the same process, the ratio to plain and the share of steps run with
overlap on; then medians over rounds. The issue's goal: at most 1.5x plain, overlap on.
A tiny model is served (one 64-wide layer, GPT-2's vocabulary and tokenizer): with the stand-ins
its size changes nothing but the memory the KV cache takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.serve_clients import percentile, prompt_texts
from bench.common import ServiceProcess, add_smoke_argument, describe_machine, write_random_model
from bench.host_standin import TINY, TOKEN_RANGE, TOKEN_STRIDE
from service.engine.gc_heap import freeze_startup_heap
from tests.processes import api_server_pids, cpu_seconds, engine_core_pid

LAUNCHER = "gpt2_host_standin"  # bench/host_standin.py's name beside another checkout
CORE_ONLY = "gpt2_host_core"  # bench/host_core.py's
MIX = "gpt2_host_mix"  # bench/host_mix.py's
MIN_TOKENS = 2048  # per measurement: enough clock ticks (10 ms) of CPU time to read


def full_sequence_bytes(model_dir: Path) -> int:
    """Keys and values of one full-context sequence of the model in float32."""
    config = json.loads((model_dir / "config.json").read_text())
    return 2 * config["n_layer"] * config["n_embd"] * 4 * config["n_positions"]


class StandinServer(ServiceProcess):
    """A checkout's server, launched through the stand-in (copied into `launcher_dir`)."""

    def __init__(self, checkout: Path, launcher_dir: Path, model_dir: Path, slots: int, new_tokens: int,
                 device_ms: float, api_servers: int = 1, extra_flags: tuple[str, ...] = (), profile: Path | None = None,
                 gc_log: Path | None = None) -> None:
        self.checkout = checkout
        flags = ["--model-dir", str(model_dir), "--max-batch-size", str(slots), "--max-waiting", str(max(64, slots)),
                 "--max-new-tokens", str(max(new_tokens, 256)), "--threads", "1"]
        if "kv_cache_bytes" in (checkout / "service" / "settings.py").read_text():
            # On a GPU the KV pool holds every row's full context (--kv-cache-memory-fraction, capped
            # there); the CPU's default of 16 sequences would cap the batch this stand-in models.
            flags += ["--kv-cache-bytes", str(slots * full_sequence_bytes(model_dir))]
        flags += extra_flags
        if api_servers != 1:  # the supervisor spawns the core (the stand-in reaches it) and N HTTP processes
            flags += ["--api-servers", str(api_servers)]
        # `-m gpt2_host_standin`, not `-m service`: the same flags, the stand-ins installed first.
        env = {"PYTHONPATH": str(launcher_dir), "STANDIN_DEVICE_MS": str(device_ms)}
        if profile is not None:
            env["STANDIN_PROFILE"] = str(profile.resolve())
        if gc_log is not None:
            env["STANDIN_GC_LOG"] = str(gc_log.resolve())
        super().__init__(flags, cwd=checkout, env=env, module=LAUNCHER)

    def check_standin(self) -> None:
        """The stand-in really decodes (not the tiny model): its ids step by TOKEN_STRIDE."""
        body = {"inputs": "the host", "parameters": {"max_new_tokens": 3, "details": True, "ignore_eos": True}}
        answer = httpx.post(f"{self.url}/generate", json=body, timeout=60).json()
        ids = [token["id"] for token in answer["details"]["tokens"]]
        if any((b - a) % TOKEN_RANGE != TOKEN_STRIDE for a, b in zip(ids, ids[1:])):
            raise RuntimeError(f"{self.checkout}: the server decoded {ids}, not the stand-in's ids: it would time the model")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


@dataclass
class HostCost:
    core_us_per_row_step: float
    core_ms_per_step: float
    rows_per_step: float
    http_us_per_token: float  # over every HTTP process (and the supervisor, with --api-servers)
    tokens_per_second: float  # what the clients received, wall time
    itl_ms: tuple[float, float]  # inter-token gaps the clients saw, p50 and p99


async def light_stream(port: int, text: str, new_tokens: int, gaps: list[float] | None = None) -> int:
    """One /generate_stream request over a raw connection; returns the events it received.

    Not httpx (bench_serve's client): with one Python process reading 256 streams, httpx's cost
    per event made the clients the bottleneck, so requests started late and the batch never
    filled. Events are counted, not parsed (the server's bytes are what is measured here).
    `gaps` gets the inter-token gaps as this client saw them: a read's first event the time since
    the previous event, the others in the same read 0 (bench_serve's convention, per event)."""
    body = json.dumps({"inputs": text, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    head = await reader.read(1 << 16)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"/generate_stream: {head[:500]!r}")
    events, tail, chunk, last = 0, b"", head, None
    while chunk:
        data = tail + chunk
        arrived = data.count(b"data:")
        events += arrived
        if arrived and gaps is not None:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            gaps.extend([0.0] * (arrived - 1))
            last = now
        tail = data[-4:]  # a "data:" cut by the read; too short to hold a whole one counted already
        chunk = await reader.read(1 << 16)
    writer.close()
    return events


async def drive_light(port: int, texts: list[str], streams: int, per_stream: int, new_tokens: int,
                      gaps: list[float] | None = None) -> int:
    async def stream(index: int) -> int:
        return sum([await light_stream(port, texts[(index + r * streams) % len(texts)], new_tokens, gaps)
                    for r in range(per_stream)])

    return sum(await asyncio.gather(*(stream(i) for i in range(streams))))


def measure(server: StandinServer, texts: list[str], streams: int, per_stream: int, new_tokens: int) -> HostCost:
    core_pid = engine_core_pid(server.process.pid)
    http_pids = [server.process.pid, *api_server_pids(server.process.pid)]  # with --api-servers: the supervisor's children
    steps_before, rows_before = server.metric("gpt2_batch_size_count"), server.metric("gpt2_batch_size_sum")
    core_before, http_before = cpu_seconds(core_pid), sum(map(cpu_seconds, http_pids))
    started, gaps = time.perf_counter(), []
    tokens = asyncio.run(drive_light(server.port, texts, streams, per_stream, new_tokens, gaps))
    seconds = time.perf_counter() - started
    core_cpu, http_cpu = cpu_seconds(core_pid) - core_before, sum(map(cpu_seconds, http_pids)) - http_before
    steps = server.metric("gpt2_batch_size_count") - steps_before
    rows = server.metric("gpt2_batch_size_sum") - rows_before
    return HostCost(core_cpu / max(rows, 1) * 1e6, core_cpu / max(steps, 1) * 1e3, rows / max(steps, 1),
                    http_cpu / max(tokens, 1) * 1e6, tokens / seconds,
                    (percentile(gaps, 0.5) * 1e3, percentile(gaps, 0.99) * 1e3))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2, help="at least; 1 stream runs enough for 2,048 tokens")
    parser.add_argument("--device-ms", type=float, default=2.0,
                        help="the stand-in device's time per step (a sleep: no host CPU; it paces the steps)")
    parser.add_argument("--rounds", type=int, default=2, help="each checkout's measurements, alternating")
    parser.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                        help="another checkout (git worktree) of the code: its server runs beside this one's")
    parser.add_argument("--api-servers", type=int, default=1,
                        help="the servers' HTTP processes (their CPU is summed); tok/s says whether they keep up")
    parser.add_argument("--flags", default="", metavar='"FLAGS"',
                        help="server flags added to this checkout's server (the reference, without --against: the same checkout without them)")
    parser.add_argument("--profile", type=Path, default=None, metavar="PATH",
                        help="this checkout's engine core and HTTP process run under cProfile (CPU time): stats in PATH.core, PATH.http")
    parser.add_argument("--gc-log", type=Path, default=None, metavar="PATH",
                        help="each server's processes time their garbage collections: PATH.<checkout>.<process>.json")
    parser.add_argument("--core-only", action="store_true", help="the engine core alone, in process (bench/host_core.py)")
    parser.add_argument("--overlap", action="store_true", help="--core-only: with the core's overlap on (as on CUDA)")
    parser.add_argument("--mix", default=None, metavar="SPEC",
                        help="--core-only: the plain batch beside a mix of features (all | grammar=1/16,beam=1/64,...)")
    parser.add_argument("--each", action="store_true", help="--mix: also every feature of the mix alone")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if (args.mix is not None or args.each) and not args.core_only:
        parser.error("--mix and --each measure the core alone: add --core-only")
    if args.each and args.mix is None:
        parser.error("--each runs the features of --mix: name them (--mix all)")
    args.min_tokens = MIN_TOKENS
    if args.smoke:
        args.streams = [8] if args.mix is not None else [1, 4]  # a mix's beam search holds 4 slots
        args.new_tokens, args.requests_per_stream, args.rounds, args.device_ms = 4, 1, 1, 0.0
        args.min_tokens = 0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    checkouts = {"new": here} | ({"old": args.against.resolve()} if args.against else {})
    extra = {"new": tuple(shlex.split(args.flags)), "old": ()}
    if extra["new"] and not args.against:
        checkouts["old"] = here  # the same code without the flags
    print(describe_machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        launcher_dir = Path(tmp) / "launcher"
        launcher_dir.mkdir()
        shutil.copy(here / "bench" / "host_standin.py", launcher_dir / f"{LAUNCHER}.py")
        if args.core_only:
            shutil.copy(here / "bench" / "host_core.py", launcher_dir / f"{CORE_ONLY}.py")
            shutil.copy(here / "bench" / "host_mix.py", launcher_dir / f"{MIX}.py")
            if args.mix is not None:
                return compare_mixes(checkouts, launcher_dir, args)
            return compare_cores(checkouts, launcher_dir, args)
        model_dir = write_random_model(Path(tmp) / "tiny", TINY)
        texts = prompt_texts(max(max(args.streams), 17), 8)
        servers = {name: StandinServer(path, launcher_dir, model_dir, max(args.streams), args.new_tokens,
                                     args.device_ms, args.api_servers, extra[name],
                                     args.profile if name == "new" else None,
                                     None if args.gc_log is None else Path(f"{args.gc_log}.{name}"))
                   for name, path in checkouts.items()}
        costs: dict[tuple[str, int], list[HostCost]] = {}
        # The clients' own start-up heap (torch among it) out of their collections: a full one
        # here would stall every stream's reading at once and count as the server's gaps.
        freeze_startup_heap("bench_host's clients")
        try:
            for server in servers.values():
                server.wait_ready()
                server.check_standin()
                asyncio.run(drive_light(server.port, texts, 2, 1, 4))  # first-request costs are not per token
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for streams in args.streams:
                    for name in order:
                        per_stream = max(args.requests_per_stream, -(-args.min_tokens // (streams * args.new_tokens)))
                        cost = measure(servers[name], texts, streams, per_stream, args.new_tokens)
                        costs.setdefault((name, streams), []).append(cost)
                        print(f"round {round_} {name:3s} {streams:4d} streams: core {cost.core_us_per_row_step:6.1f} µs/row-step,"
                              f" {cost.core_ms_per_step:6.2f} ms/step, {cost.rows_per_step:5.1f} rows/step;"
                              f" HTTP {cost.http_us_per_token:6.1f} µs/token; {cost.tokens_per_second:8.0f} tok/s;"
                              f" ITL p50/p99 {cost.itl_ms[0]:.1f}/{cost.itl_ms[1]:.1f} ms"
                              f" (the stand-in device's pace: at most {streams / args.device_ms * 1e3 if args.device_ms else float('inf'):.0f})",
                              flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print_summary(costs, {name: f"{path} {' '.join(extra[name])}".rstrip() for name, path in checkouts.items()},
                  args.streams)


def run_core(checkout: Path, launcher_dir: Path, running: int, options: list[str], smoke: bool) -> dict:
    """bench/host_core.py (copied into `launcher_dir`) in `checkout`: its JSON line."""
    command = [sys.executable, "-m", CORE_ONLY, "--running", str(running), *options]
    if smoke:
        command += ["--steps", "5", "--warmup-steps", "5"]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, check=False,
                          env=os.environ | {"PYTHONPATH": f"{launcher_dir}{os.pathsep}{checkout}"})
    if done.returncode:
        raise RuntimeError(f"{checkout}: {' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_cores(checkouts: dict[str, Path], launcher_dir: Path, args: argparse.Namespace) -> None:
    """bench/host_core.py in each checkout, alternating rounds; medians and new/old."""
    costs: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for running in args.streams:
            for name in checkouts if round_ % 2 == 0 else reversed(checkouts):
                result = run_core(checkouts[name], launcher_dir, running, ["--overlap"] * args.overlap, args.smoke)
                costs.setdefault((name, running), []).append(result["us_per_row_step"])
                share = result.get("slot_order_share")
                print(f"round {round_} {name:3s} {running:4d} running: core {result['us_per_row_step']:6.2f} µs/row-step,"
                      f" {result['rows_per_step']:5.1f} rows/step, steps read in slot order (no gathers): "
                      f"{'n/a' if share is None else f'{share:.0%}'}", flush=True)
    print(f"\ncore alone, CPU µs per row-step, medians over rounds ({', '.join(f'{n}: {p}' for n, p in checkouts.items())})")
    for running in args.streams:
        medians = {name: statistics.median(costs[(name, running)]) for name in checkouts}
        ratio = f"  new/old {medians['new'] / medians['old']:.2f}x" if "old" in medians else ""
        print(f"{running:5d} running: " + "  ".join(f"{n} {m:.2f}" for n, m in medians.items()) + ratio)


def compare_mixes(checkouts: dict[str, Path], launcher_dir: Path, args: argparse.Namespace) -> None:
    """bench/host_core.py --mix in each checkout, alternating rounds: each round's table, then per
    feature the medians of µs per row-step, of the ratio to the same run's plain batch and of
    the share of steps with overlap on (new/old: the two checkouts' µs per row-step)."""
    options = ["--mix", args.mix] + ["--each"] * args.each
    if args.smoke:  # requests short enough to finish (and show their features) within the warm-up
        options += ["--new-tokens", "4", "--steps", "4", "--warmup-steps", "30", "--rounds", "2"]
    rows: dict[tuple[str, int, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for running in args.streams:
            for name in checkouts if round_ % 2 == 0 else reversed(checkouts):
                result = run_core(checkouts[name], launcher_dir, running, options, smoke=False)
                for row in result["rows"]:
                    rows.setdefault((name, running, row["feature"]), []).append(row)
                    print(f"round {round_} {name:3s} {running:4d} running {row['feature']:<13s}"
                          f" {row['us_per_row_step']:7.2f} µs/row-step {row['ratio']:5.2f}x plain,"
                          f" overlap on {row['overlap_share']:4.0%}", flush=True)
    print(f"\ncore alone under mixed load ({args.mix}), medians over rounds "
          f"({', '.join(f'{n}: {p}' for n, p in checkouts.items())}); goal: at most 1.5x plain, overlap on")
    print(f"{'running':>7s} {'feature':<13s} " + " ".join(f"{n + ' µs/row-step':>16s} {n + ' x plain':>12s} {n + ' overlap':>12s}"
                                                     for n in checkouts) + ("  new/old" if "old" in checkouts else ""))
    for running in args.streams:
        for feature in dict.fromkeys(f for (_, r, f) in rows if r == running):
            medians = {name: {key: statistics.median(row[key] for row in rows[(name, running, feature)])
                              for key in ("us_per_row_step", "ratio", "overlap_share")}
                       for name in checkouts if (name, running, feature) in rows}
            line = " ".join(f"{m['us_per_row_step']:16.2f} {m['ratio']:11.2f}x {m['overlap_share']:12.0%}" for m in medians.values())
            if "old" in medians and "new" in medians:
                line += f"  {medians['new']['us_per_row_step'] / medians['old']['us_per_row_step']:6.2f}x"
            print(f"{running:7d} {feature:<13s} {line}")


def print_summary(costs: dict[tuple[str, int], list[HostCost]], checkouts: dict[str, Path | str], streams: list[int]) -> None:
    print(f"\nmedians over rounds ({', '.join(f'{n}: {p}' for n, p in checkouts.items())})")
    print(f"{'streams':>7s} {'checkout':>8s} {'core µs/row-step':>17s} {'core ms/step':>13s} {'rows/step':>10s} {'HTTP µs/token':>14s}"
          f" {'tok/s':>9s} {'ITL p50/p99 ms':>15s}")
    for count in streams:
        for name in checkouts:
            runs = costs.get((name, count), [])
            if not runs:
                continue
            med = lambda field: statistics.median(getattr(c, field) for c in runs)  # noqa: E731
            print(f"{count:7d} {name:>8s} {med('core_us_per_row_step'):17.1f} {med('core_ms_per_step'):13.2f}"
                  f" {med('rows_per_step'):10.1f} {med('http_us_per_token'):14.1f} {med('tokens_per_second'):9.0f}"
                  f" {statistics.median(c.itl_ms[0] for c in runs):7.1f}/{statistics.median(c.itl_ms[1] for c in runs):.1f}")
        if "old" in checkouts and costs.get(("old", count)):
            ratio = lambda field: (statistics.median(getattr(c, field) for c in costs[("new", count)])  # noqa: E731
                                   / max(statistics.median(getattr(c, field) for c in costs[("old", count)]), 1e-9))
            print(f"{count:7d} {'new/old':>8s} {ratio('core_us_per_row_step'):16.2f}x {ratio('core_ms_per_step'):12.2f}x"
                  f" {'':>10s} {ratio('http_us_per_token'):13.2f}x {ratio('tokens_per_second'):8.2f}x")


if __name__ == "__main__":
    sys.exit(main())
