"""/analyze/spectrum's work against the source document's recipe, side by side.

    .venv/bin/python -m bench.bench_spectrum [--tokens 1024] [--reps 2]

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
import statistics
import time
from pathlib import Path

import torch

from bench.common import describe_machine, paired_ratio
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
    attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    forward = time.perf_counter() - started
    sigmas = torch.stack(
        [torch.stack([torch.linalg.svdvals(head.float()).max() for head in layer[0]]) for layer in attentions]
    )  # [L, H]
    return sigmas, forward


def timed(run) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel

    ours = load_model(args.model_dir)
    reference = AutoModel.from_pretrained(args.model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    ids = text_of(GPT2Tokenizer.from_dir(args.model_dir), args.tokens)
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


if __name__ == "__main__":
    main()
