"""One command for a GPU check: every CUDA measure the project keeps, in one report.

    make gpu-check                                       # on a machine with one GPU
    .venv/bin/python -m bench.gpu_check --out runs/gpu-check [--parts serve anchor ...]
    .venv/bin/python -m bench.gpu_check --smoke          # CPU, tiny model, seconds (make test runs it)

Parts, in order, each in a process of its own with its own time limit (a slow part cannot starve
the rest; a crash or a timeout is reported in its row, never fatal to the check):
- lane: the CUDA lane, `GPT2_TEST_DEVICE=cuda pytest tests/model tests/engine tests/analysis`;
- anchor: bench/cuda_anchor.py, one greedy decode step as one CUDA graph, tok/s per batch size;
  then the same steps with the paged attention kernel (model/paged_attention.py), side by side;
- serve: the real server over HTTP (bench/bench_serve.py's clients) at each client count, each
  figure also as a ratio to the anchor at the same batch size; each count above 1 again with the
  clients spread over --client-processes processes;
- prefill-chunks: the serve part at the two largest client counts with `--max-prefill-tokens 512`
  (all clients arrive at once: what shorter prefill steps do to the inter-token p99 and TTFT);
- grammar-mix: 64 streaming clients all free against one in 16 constrained by a JSON schema
  (a string of at least 600 characters: every constrained request runs its 128 tokens under the
  mask), alternating rounds on one server: the mixed load's tok/s over the free one's;
- overlap: bench/bench_overlap.py, the engine core alone with overlap off and on, and the
  synchronising CUDA calls left in an overlapped step (with their source lines);
- speculative: bench_speculative, n-gram speculation on against off;
- prefix: bench_prefix, prefix caching on against off;
- spectrum: /analyze/spectrum at 1,024 tokens over HTTP against the document's recipe;
- stream-interval: the serve part's measure with `--stream-interval 4` at the two largest client
  counts (fewer writes per token: what it gives the served tok/s and HTTP CPU on this host);
- serve-paged: the serve part with `--decode-attention paged` (with the serve part and the
  anchor's pair: what the CUDA default is chosen by);
- api-servers: `--api-servers 1` against `4` at the largest client count: start-up time, tok/s,
  the HTTP processes' idle CPU, whether any HTTP process mapped the CUDA driver, GPU processes;
- quantize: each --quantize mode on this device: served (one request answered) or refused (its line);
- xl-streams: bench/kv_blocks.py, a random GPT-2 XL (1.5B) at --dtype with the service's KV budget on
  a GPU (0.8 of the memory free after the weights) and --max-batch-size 512: 512 streams of 128
  in / 128 out submitted at once, the largest decode batch and preemptions counted by the engine.
Writes REPORT.md and report.json to --out; prints the markdown. --smoke runs every part on the
CPU on a tiny random model with tiny sizes, so this script cannot rot between runs on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    model_dir: Path
    device: str
    dtype: str
    out: Path
    smoke: bool
    clients: list[int]
    new_tokens: int
    api_servers: list[int]
    spectrum_tokens: int
    # The serve parts drive each client count above 1 again from this many processes: one
    # process's clients may be what sets the pace at tens of streams and more (bench/serve_clients.py).
    client_processes: int = 1


@dataclass
class Part:
    name: str
    limit_s: float  # full run; a smoke run gets SMOKE_LIMIT_S
    what: str


STREAM_INTERVAL = 4  # the stream-interval part's: tokens per write
PREFILL_CHUNK = 512  # the prefill-chunks part's --max-prefill-tokens (CUDA's default: 2048)

# Each part's own cap; the check as a whole stops at --budget-s (8 minutes): a part gets what is
# left when its turn comes, so the parts measured least recently come first. Measured on one H200
# (docs/performance.md): lane 122 s, anchor 18, serve 56 (a server starts in ~27 s), api-servers 54,
# quantize 23; the bench scripts start two servers each; speculative ran past 70 s.
PARTS = [
    Part("lane", 180, "the CUDA lane: tests/model, tests/engine, tests/analysis on the device"),
    Part("anchor", 35, "one greedy decode step as one CUDA graph, replayed (bench/cuda_anchor.py); again with paged attention"),
    Part("serve", 90, "streaming clients over HTTP against one server (bench/bench_serve.py)"),
    Part("prefill-chunks", 90, f"the serve part at the two largest client counts with --max-prefill-tokens {PREFILL_CHUNK}"),
    Part("grammar-mix", 90, "64 clients all free against 1 in 16 constrained by a JSON schema, alternating (bench/serve_clients.py)"),
    Part("overlap", 60, "the engine core alone, overlap off against on, and its synchronising calls per step (bench/bench_overlap.py)"),
    Part("speculative", 120, "n-gram speculation on against off (bench/bench_speculative.py; needs the corpus in weights/.cache)"),
    Part("prefix", 80, "prefix caching on against off (bench/bench_prefix.py, repeated-prompt)"),
    Part("spectrum", 70, "/analyze/spectrum over HTTP against the document's recipe (bench/bench_spectrum.py)"),
    Part("stream-interval", 60, f"the serve part with --stream-interval {STREAM_INTERVAL} at the two largest client counts"),
    Part("serve-paged", 90, "the serve part with --decode-attention paged (model/paged_attention.py)"),
    Part("api-servers", 85, "--api-servers 1 against 4 at the largest client count"),
    Part("quantize", 30, "each --quantize mode on this device: served or refused"),
    Part("xl-streams", 120, "512 concurrent 128/128 streams of a random GPT-2 XL in the GPU's KV budget (bench/kv_blocks.py)"),
]
SMOKE_LIMIT_S = 120


# --- the parts, each run in a process of its own (`--run-part`) -----------------------------------
def part_lane(cfg: Config) -> dict:
    if cfg.smoke:  # the lane's machinery on one small CPU file: parsing and reporting stay tested
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "tests/model/test_config.py"]
        env = {**os.environ, "GPT2_TEST_DEVICE": "cpu"}
    else:
        # pytest-xdist where it is installed (the GPU image has it): the lane then fits its limit.
        spread = ["-n", str(min(12, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *spread,
                   "tests/model", "tests/engine", "tests/analysis"]
        env = {**os.environ, "GPT2_TEST_DEVICE": "cuda"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    print(done.stdout + done.stderr, flush=True)  # the part's log: every failure's traceback
    return pytest_summary(done.stdout + done.stderr) | {"exit_code": done.returncode}


def pytest_summary(output: str) -> dict:
    """Counts from pytest's closing line and the ids of what failed (its -rfE lines)."""
    closing = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", closing[-1] if closing else "")}
    # pytest's own lines ("ERROR tests/..."), not captured log records ("ERROR    service...").
    failures = [line.split(" - ")[0] for line in output.splitlines() if re.match(r"(FAILED|ERROR) tests/", line)]
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
            "errors": counts.get("error", 0) + counts.get("errors", 0), "skipped": counts.get("skipped", 0),
            "failures": failures}


def part_anchor(cfg: Config) -> dict:
    """The anchor (the engine's default attention, gather), then the same steps with the paged
    kernel (model/paged_attention.py): how the default is to be chosen. The paged rows' failure
    is reported beside the anchor, not instead of it."""
    import torch

    from bench.cuda_anchor import measure
    from model.config import DTYPES
    from model.paged_attention import paged_available
    from weights.checkpoint import load_model

    model = load_model(cfg.model_dir, device=cfg.device, dtype=DTYPES[cfg.dtype])
    options = {"start": 16, "steps": cfg.new_tokens, "reps": 1 if cfg.smoke else 3, "model": model}
    result = {"rows": measure(cfg.model_dir, cfg.device, cfg.dtype, cfg.clients, **options)}
    if not paged_available(torch.device(cfg.device)):
        result["paged_error"] = "not available here (needs CUDA and Triton)"
        return result
    try:
        result["paged_rows"] = measure(cfg.model_dir, cfg.device, cfg.dtype, cfg.clients, decode_attention="paged", **options)
    except Exception as exc:  # the kernel's compile or launch: the anchor still stands
        result["paged_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return result


def served_row(clients: int, stats) -> dict:
    from bench.serve_clients import percentile

    return {"clients": clients, "tokens": stats.tokens, "tokens_per_s": stats.tokens / stats.seconds,
            "ttft_ms": [percentile(stats.ttft, q) * 1e3 for q in (.5, .99)],
            "itl_ms": [percentile(stats.itl, q) * 1e3 for q in (.5, .99)],
            "http_cpu_ms_per_token": stats.cpu_ms_per_token("http"), "core_cpu_ms_per_token": stats.cpu_ms_per_token("core"),
            # The clients run in this one process: near 1.0 they, not the server, set the pace.
            "clients_cpu_cores": stats.cpu["clients"] / stats.seconds}


def started_server(cfg: Config, api_servers: int = 1, stream_interval: int = 1):
    """bench_serve's server for these clients, ready; and its seconds from launch to /health."""
    from bench import bench_serve

    args = bench_serve.parse_args(["--model-dir", str(cfg.model_dir), "--device", cfg.device, "--dtype", cfg.dtype,
                                   "--new-tokens", str(cfg.new_tokens), "--no-reference",
                                   "--clients", *map(str, cfg.clients), "--api-servers", str(api_servers)])
    began = time.perf_counter()
    server = bench_serve.Server(args, max(cfg.clients), api_servers=api_servers, stream_interval=stream_interval)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    startup = time.perf_counter() - began
    print(f"server with {api_servers} HTTP process(es) ready in {startup:.1f} s", flush=True)
    texts = bench_serve.prompt_texts(max(max(cfg.clients), 17), args.prompt_words)
    asyncio.run(bench_serve.drive_clients(server.url, texts, 1, 1, 4))  # its first-request costs are not throughput
    return server, startup, texts


def part_serve(cfg: Config, stream_interval: int = 1, clients: list[int] | None = None) -> dict:
    from bench.serve_clients import serve_clients

    server, startup, texts = started_server(cfg, stream_interval=stream_interval)
    try:
        counts = clients or cfg.clients
        rows = [served_row(c, serve_clients(server, texts, c, 1, cfg.new_tokens)) for c in counts]
        if cfg.client_processes > 1:
            rows += [served_row(c, serve_clients(server, texts, c, 1, cfg.new_tokens, processes=cfg.client_processes))
                     | {"client_processes": cfg.client_processes} for c in counts if c > 1]
    finally:
        server.stop()
    return {"startup_s": startup, "rows": rows, "stream_interval": stream_interval}


def part_stream_interval(cfg: Config) -> dict:
    return part_serve(cfg, STREAM_INTERVAL, cfg.clients[-2:])


def part_prefill_chunks(cfg: Config) -> dict:
    """The serve part at the two largest client counts with prompts prefilled PREFILL_CHUNK tokens a
    step (a setting's environment variable, as serve-paged's): every client arrives at once, so
    the early rows' gaps hold the later arrivals' prefill steps; smaller chunks, shorter gaps."""
    os.environ["GPT2_MAX_PREFILL_TOKENS"] = str(PREFILL_CHUNK)
    return part_serve(cfg, clients=cfg.clients[-2:]) | {"max_prefill_tokens": PREFILL_CHUNK}


# The grammar-mix part: one client in GRAMMAR_SHARE constrained, by a schema no request can
# complete within its tokens (so each one decodes all of them under the mask, as a free one does).
GRAMMAR_SHARE = 16
LONG_STRING_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 600}}, "required": ["text"]}
GRAMMAR_CLIENTS = 64
GRAMMAR_ROUNDS = 2  # of each load, in alternating order


def part_grammar_mix(cfg: Config) -> dict:
    """GRAMMAR_CLIENTS clients (the largest count, if fewer), all free against one in GRAMMAR_SHARE
    constrained, two rounds each in alternating order, spread over the client processes."""
    from bench.serve_clients import serve_clients

    clients = min(GRAMMAR_CLIENTS, max(cfg.clients))
    # ignore_eos off: a grammar decides where its text ends (the service refuses both); none can end early here.
    mixed = [{"grammar": {"type": "json", "value": LONG_STRING_SCHEMA}, "ignore_eos": False}] + [{}] * (GRAMMAR_SHARE - 1)
    server, startup, texts = started_server(cfg)
    rows = []
    try:
        for round_ in range(GRAMMAR_ROUNDS):
            for load in ("free", "mixed") if round_ % 2 == 0 else ("mixed", "free"):
                stats = serve_clients(server, texts, clients, 1, cfg.new_tokens, mixed if load == "mixed" else None,
                                      processes=cfg.client_processes)
                rows.append(served_row(clients, stats) | {"load": load, "round": round_})
    finally:
        server.stop()
    rate = {load: statistics.mean(r["tokens_per_s"] for r in rows if r["load"] == load) for load in ("free", "mixed")}
    return {"startup_s": startup, "clients": clients, "share": f"1/{GRAMMAR_SHARE}", "rows": rows,
            "mixed_over_free": rate["mixed"] / rate["free"]}


def part_serve_paged(cfg: Config) -> dict:
    """The serve part with `--decode-attention paged` (a setting's environment variable: the
    server this part process starts inherits it). Elsewhere (a smoke run) nothing: it is a CUDA kernel."""
    if cfg.device != "cuda":
        return {"skipped": "paged attention is a CUDA kernel: not run on the CPU"}
    os.environ["GPT2_DECODE_ATTENTION"] = "paged"
    return part_serve(cfg) | {"decode_attention": "paged"}


def http_pids(server) -> list[int]:
    from tests.processes import api_server_pids

    return api_server_pids(server.process.pid) or [server.process.pid]


def gpu_processes() -> list[dict] | None:
    """Processes holding GPU memory, as nvidia-smi sees them (None without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [{"pid": int(pid), "mib": int(mib)} for pid, mib in (line.split(", ") for line in out.strip().splitlines() if ", " in line)]


def part_api_servers(cfg: Config) -> dict:
    from bench.serve_clients import serve_clients
    from tests.processes import cpu_seconds

    clients = max(cfg.clients)
    rows = []
    for count in cfg.api_servers:
        server, startup, texts = started_server(cfg, count)
        try:
            pids = http_pids(server)
            before = sum(cpu_seconds(p) for p in pids)
            time.sleep(2.0)
            idle = (sum(cpu_seconds(p) for p in pids) - before) / 2.0 / len(pids) * 100
            row = {"api_servers": count, "startup_s": startup, "http_idle_cpu_percent": idle,
                   "gpu_processes": gpu_processes()}
            # A process with a CUDA context is one of nvidia-smi's compute apps (None: no nvidia-smi).
            on_gpu = {g["pid"] for g in row["gpu_processes"] or []}
            row["http_processes_on_gpu"] = None if row["gpu_processes"] is None else len(on_gpu & set(pids))
            print(f"idle: {row}", flush=True)
            rows.append(row | served_row(clients, serve_clients(server, texts, clients, 1, cfg.new_tokens)))
            print(f"served: {rows[-1]}", flush=True)
        finally:
            server.stop()
    return {"clients": clients, "rows": rows}


def bench_script(cfg: Config, part: str, module: str, *argv: str) -> dict:
    """Another bench/ script as it is, writing into this part's log (so a timeout still shows how
    far it got); its --json numbers when it writes them. A smoke run only has the script's own
    parser read these arguments: tests/bench runs each script's smoke run already, and this keeps
    the check's own command lines from rotting."""
    with tempfile.TemporaryDirectory() as tmp:
        numbers = Path(tmp) / "numbers.json"
        command = [sys.executable, "-m", module, "--model-dir", str(cfg.model_dir), "--device", cfg.device, *argv]
        if module != "bench.bench_spectrum":
            command += ["--dtype", cfg.dtype, "--json", str(numbers)]
        if cfg.smoke:
            importlib.import_module(module).parse_args(command[3:])
            return {"command": " ".join(command[1:]), "exit_code": 0, "output": f"smoke: {module}.parse_args took these arguments"}
        sys.stdout.flush()
        done = subprocess.run(command, cwd=REPO, stderr=subprocess.STDOUT)
        if done.returncode:
            raise RuntimeError(f"{module} exited with {done.returncode}")
        return {"command": " ".join(command[1:]), "exit_code": 0, "output": tail(part_log(cfg, part), 6000),
                "numbers": json.loads(numbers.read_text()) if numbers.exists() else None}


def part_overlap(cfg: Config) -> dict:
    return bench_script(cfg, "overlap", "bench.bench_overlap", "--batch", *map(str, cfg.clients), "--new-tokens",
                        str(cfg.new_tokens), "--rounds", "1")


def part_xl_streams(cfg: Config) -> dict:
    return bench_script(cfg, "xl-streams", "bench.kv_blocks", "streams", "--preset", "gpt2-xl", "--streams", "512",
                        "--max-batch-size", "512", "--kv-cache-memory-fraction", "0.8")


def part_spectrum(cfg: Config) -> dict:
    return bench_script(cfg, "spectrum", "bench.bench_spectrum", "--http", "--tokens", str(cfg.spectrum_tokens), "--reps", "3")


def part_prefix(cfg: Config) -> dict:
    return bench_script(cfg, "prefix", "bench.bench_prefix", "--workloads", "repeated-prompt", "--repeat-warm", "3")


def part_speculative(cfg: Config) -> dict:
    return bench_script(cfg, "speculative", "bench.bench_speculative", "--rounds", "1", "--extra-rounds", "0", "--clients", "16",
                        "--serial-requests", "4", "--new-tokens", "64")


def part_quantize(cfg: Config) -> dict:
    """Each mode started as a user would (bench/common.py's server lifecycle); a mode that serves
    must answer a request, one that cannot must stop with its one `cannot start:` line."""
    import httpx

    from bench.common import ServiceProcess
    from model.quantized import QUANTIZE_MODES

    rows = []
    for mode in [m for m in QUANTIZE_MODES if m != "none"]:
        flags = ["--model-dir", str(cfg.model_dir), "--device", cfg.device, "--dtype", cfg.dtype, "--quantize", mode,
                 "--max-batch-size", "4"]
        with ServiceProcess(flags, cwd=REPO) as server:
            try:
                server.wait_ready()
            except RuntimeError:
                last = (server.log_tail().strip().splitlines() or [""])[-1]
                outcome = "refused" if last.startswith("cannot start:") else f"exited {server.process.poll()}"
                rows.append({"mode": mode, "outcome": outcome, "detail": last})
                continue
            answer = httpx.post(f"{server.url}/generate", timeout=60, json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
            outcome = "served" if answer.status_code == 200 else f"answered {answer.status_code}"
            rows.append({"mode": mode, "outcome": outcome, "detail": answer.text[:200]})
    return {"rows": rows}


RUNNERS = {"lane": part_lane, "anchor": part_anchor, "serve": part_serve, "xl-streams": part_xl_streams, "overlap": part_overlap, "api-servers": part_api_servers,
           "spectrum": part_spectrum, "prefix": part_prefix, "speculative": part_speculative, "quantize": part_quantize,
           "stream-interval": part_stream_interval, "serve-paged": part_serve_paged, "grammar-mix": part_grammar_mix,
           "prefill-chunks": part_prefill_chunks}


# --- the check: each part in its own process, bounded ------------------------------------------
def run_part(part: Part, cfg: Config, limit_s: float) -> dict:
    """One part in a process group of its own, killed whole (servers and test workers too) at its limit."""
    result_file = cfg.out / f"part-{part.name}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.gpu_check", "--run-part", part.name, "--config", json.dumps(asdict(cfg), default=str)]
    log_path = part_log(cfg, part.name)
    began = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_group(process.pid)
            process.wait()
    row = {"part": part.name, "what": part.what, "limit_s": limit_s, "seconds": time.perf_counter() - began}
    if code is None:
        return row | {"status": "timeout", "log_tail": tail(log_path)}
    if code != 0 or not result_file.exists():
        return row | {"status": "crashed", "exit_code": code, "log_tail": tail(log_path)}
    return row | {"status": "ok", "result": json.loads(result_file.read_text())}


def part_log(cfg: Config, name: str) -> Path:
    return cfg.out / f"part-{name}.log"


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


def smoke_model(out: Path) -> Path:
    """A tiny random model with GPT-2's tokenizer (the tests' own), written once per run."""
    from model.config import GPT2Config
    from tests.conftest import write_tiny_model

    folder = out / "tiny-model"
    if not (folder / "config.json").exists():
        write_tiny_model(folder, GPT2Config(vocab_size=50257, n_positions=128, n_embd=64, n_layer=2, n_head=4))
    return folder


def describe(cfg: Config) -> str:
    import torch

    from bench.common import describe_machine

    gpu = torch.cuda.get_device_name(0) if cfg.device == "cuda" and torch.cuda.is_available() else "no GPU used"
    return f"{gpu}; {describe_machine()}; {cfg.model_dir}, {cfg.device} {cfg.dtype}, {cfg.new_tokens} new tokens per request"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], default=[p.name for p in PARTS])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--client-processes", type=int, default=4,
                        help="the serve parts' client counts above 1 again, their clients spread over this many processes")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole check's time, each part getting at most what is left (default 480; --smoke: 1800)")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, tiny sizes: seconds")
    parser.add_argument("--run-part", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_part:  # inside one part's process
        raw = json.loads(args.config)
        cfg = Config(**raw | {"model_dir": Path(raw["model_dir"]), "out": Path(raw["out"])})
        result = RUNNERS[args.run_part](cfg)
        (cfg.out / f"part-{args.run_part}.json").write_text(json.dumps(result, indent=2))
        return 0
    from bench.gpu_report import markdown

    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        cfg = Config(smoke_model(args.out.resolve()), "cpu", "float32", args.out.resolve(), True, [1, 2], 4, [1, 2], 32, 2)
    else:
        cfg = Config(args.model_dir.resolve(), "cuda", args.dtype, args.out.resolve(), False, args.clients,
                     args.new_tokens, [1, 4], 1024, args.client_processes)
    budget = args.budget_s or (1800 if args.smoke else 480)
    began, rows = time.perf_counter(), []
    report = {"machine": describe(cfg), "config": asdict(cfg), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for part in [p for p in PARTS if p.name in args.parts]:
        left = budget - (time.perf_counter() - began)
        if left < 1:
            rows.append({"part": part.name, "what": part.what, "limit_s": 0, "seconds": 0, "status": "skipped",
                         "log_tail": f"the check's budget of {budget:.0f} s was spent before this part's turn"})
            continue
        rows.append(run_part(part, cfg, min(left, SMOKE_LIMIT_S if cfg.smoke else part.limit_s)))
        print(f"{part.name}: {rows[-1]['status']} in {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
        # Written after every part: a check stopped from outside still leaves what it measured.
        report |= {"seconds": time.perf_counter() - began, "parts": rows}
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / "REPORT.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
