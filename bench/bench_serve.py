"""Served speed: what streaming HTTP clients get, beside the engine called directly and
transformers' generate(), on the same weights in the same run.

    .venv/bin/python -m bench.bench_serve                        # CPU: 1 and 32 clients, fp32
    .venv/bin/python -m bench.bench_serve --device cuda --dtype float16 --clients 1 16 64 256
    .venv/bin/python -m bench.bench_serve --quantize none int8 int4 --clients 1 16 --no-reference   # side by side
    .venv/bin/python -m bench.bench_serve --quantize none int8 --llama-cpp build/llama.cpp/bin  # docs/llama-cpp.md
    .venv/bin/python -m bench.bench_serve --api-servers 1 2 --clients 32 --no-reference        # HTTP processes
    git worktree add --detach /tmp/old <commit>
    .venv/bin/python -m bench.bench_serve --against /tmp/old --clients 1 16 --threads 2 --rounds 4  # old vs new
    .venv/bin/python -m bench.bench_serve --against /tmp/old --clients 16 --no-prefix-caching        # prompts computed every round

For each client count C it starts nothing new: one real server (`python -m service`, its engine
core in its own process) serves every row. C concurrent clients each stream one
`/generate_stream` request of --new-tokens tokens (greedy, ignore_eos) for a prompt of their own
(lengths differ, so every step's shapes differ); a client that finishes starts its next request
until --requests-per-client are done. Then, in this process, with the server idle:
- the engine called directly: the same C requests through service.inprocess.Engine;
- transformers' generate(): static batches of min(C, --reference-batch) padded prompts.
Printed: aggregate tok/s, TTFT and inter-token latency p50/p99 (as the clients saw them), and
served / engine and served / transformers ratios. Rerun on an idle machine: ratios are what to
compare, and only within one run.
With several --quantize modes, one server per mode runs side by side (each client count is served
by each in turn), the engine reference runs on the same weights, and the last table gives each
mode's served tok/s over the first's.
With --llama-cpp, each server also times one 512-token prompt (512 / TTFT), and llama.cpp's
llama-bench and llama-batched-bench then run on GGUFs of the same folder (bench/llama_cpp_bench.py
says what each figure is); the last table gives ours / llama.cpp.
Several --api-servers counts work the same way (one server
per count and mode); the CPU split's `http` column then sums the server's HTTP processes.

--against CHECKOUT: this checkout's server ("new") and one run from CHECKOUT's folder ("old", another
git worktree), with the same flags, both up at once. For --rounds rounds each client count is served
by one and then the other, the order swapping every round (a change in the machine's load hits both
alike): printed per round, each one's tok/s and new/old; then each client count's median tok/s and
the median of the rounds' new/old. Nothing runs in process then (the references would be this
checkout's code only).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from bench import llama_cpp_bench
from bench.common import describe_machine, load_both
from bench.llama_cpp import BUILD_ROOT, TOOLS, convert
from bench.serve_against import compare_checkouts
from bench.serve_clients import (ClientStats, Server, drive_clients, long_prompts, percentile, prefill_rate, prompt_texts,
                                 serve_clients)
from model.config import DTYPES
from model.quantized import QUANTIZE_MODES
from service.engine.types import GenerationRequest, SamplingParams
from service.inprocess import Engine, EngineConfig
from weights.checkpoint import load_model
from weights.tokenizer import GPT2Tokenizer

# --- the references -------------------------------------------------------------------------------
def engine_direct(engine: Engine, prompts: list[list[int]], clients: int, per_client: int, new_tokens: int) -> tuple[float, float]:
    """tok/s of the in-process engine, C requests in flight at a time as the clients kept them,
    and its CPU ms per token."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    pending = [GenerationRequest(f"direct-{i}", prompts[i % len(prompts)], params, time.monotonic())
               for i in range(clients * per_client)]
    start, cpu_start, tokens = time.perf_counter(), time.process_time(), 0
    engine.submit(pending[:clients])
    next_index = clients
    while engine.has_work():
        output = engine.step()
        tokens += len(output.events)
        for _ in output.finished:
            if next_index < len(pending):
                engine.submit([pending[next_index]])
                next_index += 1
    return tokens / (time.perf_counter() - start), (time.process_time() - cpu_start) / max(tokens, 1) * 1e3


def transformers_static(reference, prompts: list[list[int]], batch: int, total: int, new_tokens: int, pad: int, device: str) -> float:
    """tok/s of generate() over static batches (left-padded), `total` sequences in all."""
    done, start = 0, time.perf_counter()
    while done < total:
        rows = [prompts[(done + i) % len(prompts)] for i in range(min(batch, total - done))]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        done += len(rows)
    if device == "cuda":
        torch.cuda.synchronize()
    return done * new_tokens / (time.perf_counter() - start)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the engine (both sides)")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="default: 1 32 (CPU), 1 16 64 256 (CUDA)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--top-p", type=float, default=None,
                        help="clients sample with this top_p (do_sample, temperature 1) instead of greedy; --against only")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--client-processes", type=int, default=None,
                        help="spread the clients over this many processes; default 1 on CPU (its cores are the server's), "
                             "4 on CUDA (one process's clients read ~10k events a second: below a GPU server's pace)")
    parser.add_argument("--prompt-words", type=int, default=8, help="shortest prompt, in words")
    parser.add_argument("--reference-batch", type=int, default=None, help="generate()'s static batch; default 8 on CPU, C on CUDA")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    parser.add_argument("--quantize", nargs="+", choices=QUANTIZE_MODES, default=["none"],
                        help="the servers' --quantize; several: one server each, side by side")
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="BIN_DIR",
                        help="llama.cpp's tools (make llama-cpp: build/llama.cpp/bin): run beside ours, on GGUFs of --model-dir")
    parser.add_argument("--llama-cpp-repetitions", type=int, default=3, help="llama-bench -r; also our 512-token prompts")
    parser.add_argument("--gguf-dir", type=Path, default=BUILD_ROOT / "gguf", help="where the GGUFs are converted to")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the servers write a stream's tokens this many at a time (its first and last at once)")
    parser.add_argument("--api-servers", nargs="+", type=int, default=[1],
                        help="the servers' --api-servers (HTTP processes); several: one server each, side by side")
    parser.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                        help="another checkout (git worktree) of the code: its server beside this one's, alternating (new/old)")
    parser.add_argument("--rounds", type=int, default=4, help="with --against: each checkout's measurements per client count")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="the servers' prefix cache (every round sends the same prompts, which a cache reuses)")
    args = parser.parse_args(argv)
    if args.against:
        if not (args.against / "service" / "__main__.py").is_file():
            parser.error(f"--against {args.against}: not a checkout of this project (no service/__main__.py there)")
        if len(args.quantize) > 1 or len(args.api_servers) > 1 or args.llama_cpp:
            parser.error("--against compares one server per checkout: one --quantize mode and one --api-servers count, no --llama-cpp")
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        # The old server runs in the other checkout's folder: paths must not depend on the folder.
        args.against, args.model_dir = args.against.resolve(), args.model_dir.resolve()
    args.clients = args.clients or ([1, 32] if args.device == "cpu" else [1, 16, 64, 256])
    args.client_processes = args.client_processes or (1 if args.device == "cpu" else 4)
    if args.llama_cpp:
        if args.device != "cpu":
            parser.error("--llama-cpp compares on the CPU only (it is built CPU only)")
        missing = [(mode, args.dtype) for mode in args.quantize if (mode, args.dtype) not in llama_cpp_bench.GGUF_TYPE]
        if missing:
            parser.error(f"--llama-cpp has no GGUF type to set beside --quantize/--dtype {missing}; "
                         f"it compares {sorted(llama_cpp_bench.GGUF_TYPE)}")
        if not all((args.llama_cpp / tool).is_file() for tool in TOOLS):
            parser.error(f"--llama-cpp {args.llama_cpp}: no {', '.join(TOOLS)} there (build them with `make llama-cpp`)")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    slots = max(args.clients)
    texts = prompt_texts(max(slots, 17), args.prompt_words)
    if args.against:
        return compare_checkouts(args, texts)
    if args.top_p is not None:
        raise SystemExit("--top-p is for --against (the in-process references are greedy)")
    tokenizer = GPT2Tokenizer.from_dir(args.model_dir)
    prompts = [tokenizer.encode(t) for t in texts]
    prefill_texts = long_prompts(tokenizer, llama_cpp_bench.PREFILL_TOKENS, args.llama_cpp_repetitions + 1)
    llama_cpp, ggufs, beside = None, {}, []
    if args.llama_cpp:
        # The same thread count as our engine's; sequences with prompts as long as our clients'.
        llama_cpp = llama_cpp_bench.LlamaCpp(args.llama_cpp, torch.get_num_threads(), args.new_tokens,
                                             round(statistics.mean(len(p) for p in prompts[:slots])), args.llama_cpp_repetitions)
        for mode in dict.fromkeys(args.quantize):
            (ggufs[mode],) = convert(args.model_dir, args.gguf_dir, (llama_cpp_bench.GGUF_TYPE[mode, args.dtype],),
                                     bin_dir=args.llama_cpp)
    servers = {(mode, n): Server(args, slots, mode, n, stream_interval=args.stream_interval, prefix_caching=args.prefix_caching)
               for mode in dict.fromkeys(args.quantize) for n in dict.fromkeys(args.api_servers)}
    try:
        for server in servers.values():
            server.wait_ready()
            # One short request first: the server's own first-request costs are not throughput.
            asyncio.run(drive_clients(server.url, texts, 1, 1, 4))
        # Each client count on every server in turn (a change in the machine's load hits all alike),
        # llama.cpp's figure for it right after ours.
        served = {}
        for c in args.clients:
            for (mode, n), server in servers.items():
                served[(mode, n), c] = stats = serve_clients(server, texts, c, args.requests_per_client, args.new_tokens,
                                                              processes=args.client_processes)
                if llama_cpp:
                    beside.append(llama_cpp_row(args, mode, stats.tokens / stats.seconds, *llama_cpp.clients(ggufs[mode], c)))
        if llama_cpp:
            for (mode, n), server in servers.items():
                ours = prefill_rate(server, prefill_texts, llama_cpp_bench.PREFILL_TOKENS)
                beside.append(llama_cpp_row(args, mode, ours, *llama_cpp.prefill(ggufs[mode])))
    finally:
        for server in servers.values():
            server.stop()

    ours, reference = load_both(args.model_dir, dtype)
    ours, reference = ours.to(args.device), reference.to(args.device)
    ours.prepare()
    max_len = max(len(p) for p in prompts) + args.new_tokens
    print(describe_machine())
    print(f"{args.model_dir}, {args.device} {args.dtype}, {args.new_tokens} new tokens per request, "
          f"{args.requests_per_client} request(s) per client\n")
    hf_rates: dict[int, float | None] = {}
    models = {"none": ours}
    for (mode, n), server in servers.items():
        if mode not in models:
            models[mode] = load_model(args.model_dir, device=args.device, dtype=dtype)
            models[mode].quantize(mode)
        if len(servers) > 1:
            print(f"--quantize {mode} --api-servers {n}")
        report(args, {c: served[(mode, n), c] for c in args.clients}, models[mode], reference, tokenizer, prompts,
               server.engine_config(tokenizer.eos_token_id, max_len), hf_rates)
    if len(servers) > 1:
        first, *others = servers.values()
        print(f"\nserved tok/s over {first.label}'s")
        print(f"{'clients':>7s} " + " ".join(f"{s.label:>14s}" for s in others))
        for c in args.clients:
            rate = {key: served[key, c].tokens / served[key, c].seconds for key in servers}
            base = rate[next(iter(servers))]
            print(f"{c:7d} " + " ".join(f"{rate[key] / base:13.2f}x" for key in list(servers)[1:]))
    if llama_cpp:
        print(f"\nbeside llama.cpp ({args.llama_cpp}, {llama_cpp.threads} thread(s); batched-bench prompts of "
              f"{llama_cpp.prompt_tokens} tokens), each llama.cpp figure measured right after ours")
        llama_cpp_bench.print_comparison(beside)
    print(f"\n{describe_machine()}")


def llama_cpp_row(args, mode: str, ours: float, workload: str, theirs: float) -> tuple[str, str, float, float]:
    precision = f"{args.dtype if mode == 'none' else mode} / {llama_cpp_bench.GGUF_TYPE[mode, args.dtype].upper()}"
    return precision, workload, ours, theirs


def report(args, served: dict[int, ClientStats], ours, reference, tokenizer, prompts, engine_config: EngineConfig,
           hf_rates: dict[int, float | None]) -> None:
    """One table: each client count as served, beside the engine called directly on the same
    weights and transformers (measured once per client count, in hf_rates)."""
    header = f"{'clients':>7s} {'served tok/s':>13s} {'engine tok/s':>13s} {'served/engine':>14s} {'HF tok/s':>10s} {'served/HF':>10s} {'TTFT p50/p99 ms':>17s} {'ITL p50/p99 ms':>16s}"
    print(header)
    cpu_rows = []
    with torch.inference_mode():
        # One engine for every client count, as one server served them all (its prefix cache
        # and, on CUDA, its captured graphs carried from row to row alike).
        engine = Engine(ours, tokenizer, engine_config)
        for clients in args.clients:
            stats = served[clients]
            served_rate = stats.tokens / stats.seconds
            engine_direct(engine, prompts, min(clients, 2), 1, 4)  # warm-up
            direct, direct_cpu = engine_direct(engine, prompts, clients, args.requests_per_client, args.new_tokens)
            cpu_rows.append(f"{clients:7d} {stats.cpu_ms_per_token('http'):8.2f} {stats.cpu_ms_per_token('core'):8.2f} "
                            f"{stats.cpu_ms_per_token('clients'):8.2f} {direct_cpu:14.2f}")
            if clients not in hf_rates:
                hf_rates[clients] = None
                if not args.no_reference:
                    batch = args.reference_batch or (clients if args.device == "cuda" else min(clients, 8))
                    total = clients * args.requests_per_client
                    hf_rates[clients] = transformers_static(reference, prompts, batch, total, args.new_tokens,
                                                            tokenizer.eos_token_id, args.device)
            hf = hf_rates[clients]
            ttft = f"{percentile(stats.ttft, .5) * 1e3:.0f}/{percentile(stats.ttft, .99) * 1e3:.0f}"
            itl = f"{percentile(stats.itl, .5) * 1e3:.1f}/{percentile(stats.itl, .99) * 1e3:.1f}"
            hf_text = f"{hf:10.1f} {served_rate / hf:9.2f}x" if hf else f"{'':10s} {'':10s}"
            print(f"{clients:7d} {served_rate:13.1f} {direct:13.1f} {served_rate / direct:13.2f}x {hf_text} {ttft:>17s} {itl:>16s}")
    print("\nCPU ms per generated token (all threads): served by the HTTP process, its engine core, the clients;")
    print("and the engine called directly (the same work in one process, nothing else running)")
    print(f"{'clients':>7s} {'http':>8s} {'core':>8s} {'clients':>8s} {'engine direct':>14s}")
    print("\n".join(cpu_rows))


if __name__ == "__main__":
    main()
