"""/analyze/spectrum's work against the source document's recipe, side by side.

    .venv/bin/python -m bench.bench_spectrum [--tokens 1024] [--reps 2]          # in-process
    .venv/bin/python -m bench.bench_spectrum --http [--tokens 1024] [--reps 3]   # over HTTP
    .venv/bin/python -m bench.bench_spectrum --http --device cuda                # both on the GPU

--http starts the real server (`python -m service`) on a free port, waits for /health, and POSTs
`token_ids` to /analyze/spectrum with method=fast: the first request right after start-up is
timed on its own, then requests alternate with runs of the recipe in this process (the server
idles meanwhile). Times are wall clock, client side, the whole HTTP round trip included.

One text of --tokens tokens, all layers and heads of the model in --model-dir (GPT-2 124M:
144 attention matrices). The document's recipe: transformers' AutoModel with eager attention and
output_attentions=True, then `torch.linalg.svdvals(head.float()).max()` per head. Ours: the
service's `analyze` (our forward with attention probabilities, plus the rank-collapse
residuals and column-sum bounds), method=fast. Runs alternate; each prints wall and CPU seconds
(CPU = this process's CPU time: on a machine shared with other jobs it measures work rather
than waiting for a core). The ratio is the median over repetitions of recipe / ours, each pair
measured back to back. Also checks that the two agree on every head (1e-4 relative).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.common import ServiceProcess, describe_machine, paired_ratio
from model.analysis import analyze
from weights.checkpoint import load_model
from weights.tokenizer import GPT2Tokenizer

PASSAGE = (
    "Pre-LN moves the layer norm to the input of every sub-block, so each layer starts from a "
    "normalised residual stream and the scale of queries and keys cannot grow with depth. "
)


def text_of(tokenizer: GPT2Tokenizer, tokens: int) -> list[int]:
    ids = tokenizer.encode(PASSAGE)
    return (ids * (tokens // len(ids) + 1))[:tokens]


@torch.no_grad()
def document_recipe(model, ids: list[int]) -> tuple[torch.Tensor, float]:
    """σ_max per head [L, H] and the seconds its forward took, as the document's script runs."""
    started = time.perf_counter()
    attentions = model(torch.tensor([ids], device=model.device), output_attentions=True).attentions
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    forward = time.perf_counter() - started
    sigmas = torch.stack(
        [torch.stack([torch.linalg.svdvals(head.float()).max() for head in layer[0]]) for layer in attentions]
    )  # [L, H]
    return sigmas.cpu(), forward  # .cpu() waits for the device: the time is the whole recipe


def timed(run) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--http", action="store_true", help="time the real server over HTTP")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both the recipe and ours run")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel

    reference = AutoModel.from_pretrained(args.model_dir, attn_implementation="eager", dtype=torch.float32)
    reference = reference.to(args.device).eval()
    ids = text_of(GPT2Tokenizer.from_dir(args.model_dir), args.tokens)
    if args.http:
        http_benchmark(args, reference, ids)
        return
    ours = load_model(args.model_dir, device=args.device)  # analyze returns host tensors: timed to the end
    config = ours.config
    print(describe_machine())
    count = config.n_layer * config.n_head
    print(f"{config.n_layer} layers x {config.n_head} heads = {count} matrices of {len(ids)}x{len(ids)}")

    # Warm-up: first touches of large buffers, and our weight spectra (computed once per model).
    analyze(ours, [ids], "fast")
    document_recipe(reference, ids[:64])
    walls: dict[str, list[float]] = {"recipe": [], "ours": []}
    cpus: dict[str, list[float]] = {"recipe": [], "ours": []}
    worst = 0.0
    for rep in range(args.reps):
        (sigmas, recipe_forward), wall, cpu = timed(lambda: document_recipe(reference, ids))
        walls["recipe"].append(wall)
        cpus["recipe"].append(cpu)
        report, wall, cpu = timed(lambda: analyze(ours, [ids], "fast"))
        walls["ours"].append(wall)
        cpus["ours"].append(cpu)
        measured = report.sequences[0].spectral_norm.double()
        worst = max(worst, ((measured - sigmas.double()).abs() / sigmas.double()).max().item())
        print(
            f"rep {rep}: recipe {walls['recipe'][-1]:6.2f} s wall ({recipe_forward:.2f} forward), {cpus['recipe'][-1]:6.2f} s CPU"
            f" | ours {walls['ours'][-1]:5.2f} s wall ({report.seconds['forward']:.2f} forward,"
            f" {report.seconds['spectral_norm']:.2f} norms), {cpus['ours'][-1]:5.2f} s CPU"
        )
    print(f"largest relative difference from the recipe's svdvals over {measured.numel()} heads: {worst:.1e}")
    print(
        f"median: recipe {statistics.median(walls['recipe']):.2f} s, ours {statistics.median(walls['ours']):.2f} s wall;"
        f" ratio {paired_ratio(walls['recipe'], walls['ours']):.1f}x wall, {paired_ratio(cpus['recipe'], cpus['ours']):.1f}x CPU"
    )


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def served(model_dir: Path, threads: int | None, device: str = "cpu", startup_timeout: float = 300.0) -> Iterator[str]:
    """The real server on a free port; yields its base URL once /health answers."""
    flags = ["--model-dir", str(model_dir), "--device", device] + (["--threads", str(threads)] if threads else [])
    with ServiceProcess(flags) as server:
        server.wait_ready(startup_timeout)
        yield server.url


def http_benchmark(args: argparse.Namespace, reference, ids: list[int]) -> None:
    print(describe_machine())
    body = {"token_ids": [ids], "method": "fast"}
    walls: dict[str, list[float]] = {"recipe": [], "http": []}
    worst = 0.0
    started = time.perf_counter()
    with served(args.model_dir, args.threads, args.device) as base:
        print(f"server ready in {time.perf_counter() - started:.1f} s; {len(ids)} tokens, method=fast, POST token_ids")
        report, first, _ = timed(lambda: post_json(base + "/analyze/spectrum", body))
        print(f"first request after start-up: {first:.2f} s (server: {report['seconds']})")
        document_recipe(reference, ids[:64])  # warm-up of the reference
        for rep in range(args.reps):
            (sigmas, _), wall, _ = timed(lambda: document_recipe(reference, ids))
            walls["recipe"].append(wall)
            report, wall, _ = timed(lambda: post_json(base + "/analyze/spectrum", body))
            walls["http"].append(wall)
            measured = torch.tensor([layer["spectral_norm"] for layer in report["sequences"][0]["layers"]], dtype=torch.float64)
            worst = max(worst, ((measured - sigmas.double()).abs() / sigmas.double()).max().item())
            print(f"rep {rep}: recipe {walls['recipe'][-1]:6.2f} s | HTTP {walls['http'][-1]:5.2f} s (server: {report['seconds']})")
    recipe = statistics.median(walls["recipe"])
    print(f"largest relative difference from the recipe's svdvals over {measured.numel()} heads: {worst:.1e}")
    print(
        f"median: recipe {recipe:.2f} s, HTTP {statistics.median(walls['http']):.2f} s;"
        f" ratio {paired_ratio(walls['recipe'], walls['http']):.1f}x (paired median),"
        f" first request {recipe / first:.1f}x (recipe median / first)"
    )


if __name__ == "__main__":
    main()
