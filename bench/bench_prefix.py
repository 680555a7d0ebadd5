"""Prefix caching and chunked prefill, as HTTP clients see them: every workload against a server
with the feature and one without, in the same run, on the same weights.

    .venv/bin/python -m bench.bench_prefix                                  # all four workloads, CPU fp32
    .venv/bin/python -m bench.bench_prefix --workloads mc-scoring repeated-prompt --json runs/prefix.json
    .venv/bin/python -m bench.bench_prefix --model-dir weights/shakespeare   # 256-token context

Servers (`python -m service`, one at a time, each stopped before the next starts; all with the
same --max-batch-size, --max-new-tokens, --device, --dtype, --threads):
  on       --prefix-caching     --max-prefill-tokens P      P: --prefill-tokens (default: --chunk;
  off      --no-prefix-caching  --max-prefill-tokens P         0 leaves the flag out, the server's default)
  chunked  --prefix-caching     --max-prefill-tokens CHUNK  (--chunk; when P = CHUNK, "on" itself)
  whole    --prefix-caching     --max-prefill-tokens 4096   (one prefill per prompt, the old behaviour)
CHUNK (--chunk) defaults to the server's own budget on CPU: 256, CPU_PREFILL_TOKENS in service/settings.py.
Two servers compared differ in one flag: on/off in the prefix cache (mc-scoring, repeated-prompt,
fresh-prompts), chunked/whole in the prefill chunk (long-arrival; both keep the cache on, which
its distinct prompts never hit). A server is started only if a chosen workload needs it, and
once per distinct configuration: by default three (on, off, whole), about 2 minutes in all on a
2-core CPU with weights/gpt2. The goals are sized for weights/gpt2 (124M): with a small model
such as weights/shakespeare, fixed per-request costs dominate and the ratios shrink.

Workloads (--workloads; prompt sizes are in tokens for GPT-2's 1024-token context and scaled by
n_positions/1024 from the model folder's config.json, then cut to fit the context; --chunk and
the numbers of new tokens are not scaled):
  mc-scoring       lm-evaluation-harness-style multiple choice: --mc-questions contexts of
                   --mc-context tokens, each with --mc-choices continuations of --mc-continuation
                   words. One POST /v1/completions per choice, as lm-eval's local-completions
                   sends it (token ids, echo, logprobs=1, temperature 0; max_tokens=0, which this
                   server allows with echo, where lm-eval asks 1 and drops it). --mc-clients
                   clients take questions from one queue; each sends its question's choices one
                   after another, so choice 2-4 can find the context cached (sent at once they
                   would be prefilled together, before any is cached). Goal: requests/s on/off
                   >= 3. Also: the continuation logprobs of "on" equal those of "off" within 1e-4.
  repeated-prompt  one --repeat-tokens prompt: sent once (cold), then --repeat-warm times more;
                   each POST /generate_stream with max_new_tokens=1, TTFT = send to the first
                   `data:` event. Goal: warm TTFT (median) of "on" <= 10% of its cold TTFT.
  long-arrival     --arrival-streams clients stream --arrival-new-tokens tokens each (greedy,
                   ignore_eos, short distinct prompts); once every one has --arrival-after tokens,
                   one more client sends a --long-tokens prompt (--long-new-tokens tokens). The
                   streams' inter-token gaps are taken over the arrival window (long prompt sent
                   -> its first token; a gap counts if it overlaps the window) and over the whole
                   run. Chunked (--chunk) against whole-prompt prefill. Goal: chunked, arrival
                   p99 <= 2x arrival median.
  fresh-prompts    no reuse: --fresh-clients clients each stream --fresh-requests distinct random
                   prompts of --fresh-tokens tokens, --fresh-new-tokens tokens each. Goal:
                   aggregate tok/s on/off >= 0.95 (the cache costs nothing where it never hits).

Prompts are words of a fixed list (each one token with its leading space), drawn by seeded
generators: the same prompts on every server, sharing no prefix beyond chance across
workloads. Each server first answers a few warm-up requests that share nothing with them.

Printed: the machine, the command line, each server's command; per workload what the server's
/metrics counted meanwhile (gpt2_prompt_tokens*, any *prefix*, *cache_hit* or *cached* sample:
prompt tokens computed and found cached, so "on" is seen to hit and "off" not to); and one table:
each workload's numbers on both servers (A, B), A/B, the goal and whether it was met.
--json PATH writes it all.
Rerun on an idle machine: the servers run one after the other, so a change in load between
them shows up as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_clients import drive_clients
from bench.common import ServiceProcess, add_server_arguments, describe_machine, service_flags
from bench.prefix_workloads import Prompts, Row, Sizes, mc_compare, rows_for, run_workload, workload_inputs
from service.settings import CPU_PREFILL_TOKENS
from weights.tokenizer import GPT2Tokenizer

WORKLOADS = ("mc-scoring", "repeated-prompt", "long-arrival", "fresh-prompts")
CACHE_FLAGS = {True: ["--prefix-caching"], False: ["--no-prefix-caching"]}
PREFILL_FLAG = "--max-prefill-tokens"
WHOLE_PREFILL_TOKENS = 4096  # more than any prompt: one prefill per prompt, the old behaviour


# --- servers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerConfig:
    prefix_caching: bool
    prefill_tokens: int | None  # None: the server's default (the flag is not passed)

    def flags(self) -> list[str]:
        flags = list(CACHE_FLAGS[self.prefix_caching])
        if self.prefill_tokens is not None:
            flags += [PREFILL_FLAG, str(self.prefill_tokens)]
        return flags

    def describe(self) -> str:
        chunk = "server default" if self.prefill_tokens is None else self.prefill_tokens
        return f"prefix cache {'on' if self.prefix_caching else 'off'}, {PREFILL_FLAG} {chunk}"


class PrefixServer(ServiceProcess):
    """A server with a configuration's flags (`config.flags()`: a ServerConfig, or bench_speculative's)."""

    def __init__(self, args: argparse.Namespace, slots: int, max_new_tokens: int, config) -> None:
        self.config = config
        super().__init__(service_flags(args, slots, max_new_tokens) + config.flags())

    def wait_ready(self) -> None:
        try:
            super().wait_ready()
        except RuntimeError as exc:
            refused = [line for line in str(exc).splitlines() if "unrecognized arguments" in line]
            if refused:  # argparse's own line, without the usage text before it
                raise SystemExit(f"this server's `python -m service` does not take {' '.join(self.config.flags())}: "
                                 f"{refused[-1].strip()}") from None
            raise

    def model_name(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]

    def prefix_metrics(self) -> dict[str, float]:
        """What the server counts about prompt tokens and its prefix cache (gpt2_prompt_tokens*,
        and any sample named *prefix*, *cache_hit* or *cached*: names not fixed in advance)."""
        found = {}
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.lower()
                wanted = name.startswith("gpt2_prompt_tokens") or any(w in name for w in ("prefix", "cache_hit", "cached"))
                if wanted and not name.endswith("_created"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return found


def warm_up(server: PrefixServer, prompts: Prompts, sizes: Sizes, model: str) -> None:
    """The server's first-request costs, on prompts no workload shares."""
    short = [prompts.text(12, f"warm-short-{i}") for i in range(2)]
    asyncio.run(drive_clients(server.url, short, 2, 1, 4))
    asyncio.run(drive_clients(server.url, [prompts.text(sizes.n_positions // 2, "warm-long")], 1, 1, 2))
    body = {"model": model, "prompt": prompts.ids(16, "warm-score"), "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions warm-up: {response.status_code} {response.text[:1000]}")


# --- the report ---------------------------------------------------------------------------------
def number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 0.01:
        return f"{value:.3g}"
    return f"{value:.1e}"


def print_table(rows: list[Row], sides: dict[str, tuple[str, str]], configs: dict[str, ServerConfig]) -> None:
    print(f"{'workload':16s} {'metric':32s} {'A':>9s} {'B':>9s} {'A/B':>7s}  {'goal':26s} met")
    current = None
    for row in rows:
        if row.workload != current:
            current = row.workload
            a, b = sides[current]
            print(f"{current:16s} A = {a} ({configs[a].describe()}), B = {b} ({configs[b].describe()})")
        met = "" if row.met is None else ("yes" if row.met else "NO")
        ratio = f"{row.ratio:6.2f}x" if row.ratio is not None else ""
        print(f"{'':16s} {row.metric:32s} {number(row.a):>9s} {number(row.b):>9s} {ratio:>7s}  {row.goal:26s} {met}")


def finite(value):
    """JSON without NaN (not JSON): None instead; tuple keys as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else "-".join(map(str, k))): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


# --- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, Path("weights/gpt2"), WORKLOADS)
    parser.add_argument("--chunk", type=int, default=CPU_PREFILL_TOKENS,
                        help="--max-prefill-tokens of the chunked server; default %(default)s, the server's own on CPU")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="--max-prefill-tokens of the on/off pair; default --chunk; 0: the server's default")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    mc = parser.add_argument_group("mc-scoring")
    mc.add_argument("--mc-questions", type=int, default=6)
    mc.add_argument("--mc-choices", type=int, default=4)
    mc.add_argument("--mc-context", type=int, nargs=2, default=(200, 500), metavar=("MIN", "MAX"), help="tokens (scaled)")
    mc.add_argument("--mc-continuation", type=int, nargs=2, default=(3, 12), metavar=("MIN", "MAX"), help="words = tokens")
    mc.add_argument("--mc-clients", type=int, default=2, help="questions scored at once")
    rp = parser.add_argument_group("repeated-prompt")
    rp.add_argument("--repeat-tokens", type=int, default=900, help="tokens (scaled)")
    rp.add_argument("--repeat-warm", type=int, default=3, help="sends after the cold one")
    la = parser.add_argument_group("long-arrival")
    la.add_argument("--arrival-streams", type=int, default=16)
    la.add_argument("--arrival-new-tokens", type=int, default=96)
    la.add_argument("--arrival-after", type=int, default=4, help="tokens every stream has before the long prompt")
    la.add_argument("--long-tokens", type=int, default=1000, help="tokens (scaled)")
    la.add_argument("--long-new-tokens", type=int, default=8)
    fp = parser.add_argument_group("fresh-prompts")
    fp.add_argument("--fresh-clients", type=int, default=8)
    fp.add_argument("--fresh-requests", type=int, default=3, help="per client")
    fp.add_argument("--fresh-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"), help="tokens (scaled)")
    fp.add_argument("--fresh-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    counts = ("mc_questions", "mc_choices", "mc_clients", "repeat_warm", "arrival_streams", "arrival_new_tokens",
              "arrival_after", "long_tokens", "long_new_tokens", "fresh_clients", "fresh_requests", "fresh_new_tokens",
              "chunk")
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefill_tokens is None:
        args.prefill_tokens = args.chunk
    args.workloads = [w for w in WORKLOADS if w in args.workloads]  # one order, each once
    return args


def plan(args: argparse.Namespace) -> tuple[dict[str, ServerConfig], dict[str, tuple[str, str]]]:
    """The servers to start (in order) and which two each workload compares."""
    pair = args.prefill_tokens or None
    on, off = ServerConfig(True, pair), ServerConfig(False, pair)
    chunked, whole = ServerConfig(True, args.chunk), ServerConfig(True, WHOLE_PREFILL_TOKENS)
    named = {"on": on, "off": off, "chunked": chunked, "whole": whole}
    sides = {w: ("on", "off") for w in args.workloads if w != "long-arrival"}
    if "long-arrival" in args.workloads:
        sides["long-arrival"] = ("chunked", "whole")
    # One server per distinct configuration, named after the first role it plays.
    configs: dict[str, ServerConfig] = {}
    alias = {}
    for role in ("on", "off", "chunked", "whole"):
        if not any(role in pair_ for pair_ in sides.values()):
            continue
        same = next((name for name, c in configs.items() if c == named[role]), None)
        if same is None:
            configs[role] = named[role]
            same = role
        alias[role] = same
    sides = {w: (alias[a], alias[b]) for w, (a, b) in sides.items()}
    return configs, sides


def run_server(args, name: str, config: ServerConfig, workloads: list[str], slots: int, sizes: Sizes,
               prompts: Prompts, inputs: dict) -> tuple[dict, dict, list[str]]:
    server = PrefixServer(args, slots, sizes.max_new_tokens, config)
    print(f"[{name}] {shlex.join(server.command)}", flush=True)
    results, metrics = {}, {}
    with serving(server, name):
        server.wait_ready()
        model = server.model_name()
        warm_up(server, prompts, sizes, model)
        for workload in workloads:
            start, before = time.perf_counter(), server.prefix_metrics()
            results[workload] = run_workload(workload, server.url, model, inputs, sizes, args)
            if workload == "long-arrival":
                timeline = " ".join(f"{t * 1e3:.0f}" for t in results[workload]["stream0_token_times_from_send_s"])
                print(f"[{name}] stream 0's tokens, ms after the long prompt was sent (its first token at "
                      f"{results[workload]['long_ttft_s'] * 1e3:.0f}): {timeline}", flush=True)
                if results[workload]["streams_done_before_first_token"]:
                    print(f"[{name}] warning: {results[workload]['streams_done_before_first_token']} streams ended "
                          "before the long prompt's first token; raise --arrival-new-tokens", flush=True)
            seconds, after = time.perf_counter() - start, server.prefix_metrics()
            metrics[workload] = {k: v - before.get(k, 0.0) for k, v in after.items()}
            counted = ", ".join(f"{k.removeprefix('gpt2_')} {number(v)}" for k, v in metrics[workload].items())
            print(f"[{name}] {workload}: {seconds:.1f} s; {counted or 'no prompt-token metrics'}", flush=True)
    return results, metrics, server.command


@contextmanager
def serving(server: ServiceProcess, name: str):
    """Stop the server however the block ends; on an error, show the end of its log first."""
    try:
        yield server
    except BaseException:
        tail = server.log_tail()
        if tail:
            print(f"[{name}] server log, last lines:\n{tail}", file=sys.stderr)
        raise
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n_positions = json.loads((args.model_dir / "config.json").read_text())["n_positions"]
    sizes = Sizes.build(args, n_positions)
    tokenizer = GPT2Tokenizer.from_dir(args.model_dir)
    prompts = Prompts(tokenizer)
    inputs = workload_inputs(prompts, sizes, args)
    slots = max(2, args.mc_clients, args.fresh_clients, args.arrival_streams + 1 if "long-arrival" in args.workloads else 0)
    configs, sides = plan(args)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.bench_prefix", *sys.argv[1:]])
    print(describe_machine())
    print(command)
    print(f"{args.model_dir}: {n_positions}-token context, {args.device} {args.dtype}; sizes {asdict(sizes)}\n", flush=True)

    results: dict[str, dict] = {}
    metrics: dict[str, dict] = {}
    commands: dict[str, list[str]] = {}
    for name, config in configs.items():
        workloads = [w for w in args.workloads if name in sides[w]]
        results[name], metrics[name], commands[name] = run_server(args, name, config, workloads, slots, sizes, prompts, inputs)

    rows, extras = [], {}
    for workload in args.workloads:
        a, b = sides[workload]
        extra = mc_compare(inputs["questions"], results[a][workload], results[b][workload]) if workload == "mc-scoring" else {}
        extras[workload] = extra
        rows += rows_for(workload, results[a][workload], results[b][workload], extra)

    print("\nprompt tokens each workload sent, computed and found cached (the servers' /metrics, deltas):")
    for name, per_workload in metrics.items():
        for workload, counted in per_workload.items():
            shown = ", ".join(f"{k.removeprefix('gpt2_')} {number(v)}" for k, v in counted.items()) or "none exported"
            print(f"  {name:6s} {workload:16s} {shown}")
    print()
    print(describe_machine())
    print(command + "\n")
    print_table(rows, sides, configs)
    met = [r.met for r in rows if r.met is not None]
    print(f"\ngoals met: {sum(met)} of {len(met)}")

    if args.json:
        for server_results in results.values():
            if "mc-scoring" in server_results:
                server_results["mc-scoring"].pop("answers")  # their sums are in loglikelihoods
        report = {
            "machine": describe_machine(), "command": command, "model_dir": str(args.model_dir),
            "n_positions": n_positions, "device": args.device, "dtype": args.dtype, "sizes": asdict(sizes),
            "servers": {name: {"config": asdict(c), "command": commands[name]} for name, c in configs.items()},
            "sides": sides, "metrics": metrics, "results": results, "comparisons": extras,
            "rows": [asdict(r) for r in rows],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(finite(report), indent=2) + "\n")
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()