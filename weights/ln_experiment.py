"""Pre-LN against Post-LN, trained side by side: the write-up's §2.2–2.3 claim as an experiment.

    python -m weights.ln_experiment [--out runs/ln-experiment] [--figures docs/figures] [--steps 240] [--seed 0]

Twins of one width, data, batch, steps, seed and initialisation (GPT-2's), differing only in where
the LayerNorms sit (model/gpt2.py against model/post_ln.py), at two depths, each with and without
learning-rate warm-up: 8 runs, about 26 minutes on 2 cores (opt-in; never run by the tests). For
every run it records the training and held-out loss curves, the gradient norm of every block at
initialisation and during training (before clipping), and every layer's mean attention spectral
norm on held-out texts at a few checkpoints, measured by the code /analyze/spectrum runs
(model/analysis.py). It writes results.json and the final models of the deepest warm-up pair
(for `gpt2-analyze --model-dir A --model-dir B`) under --out, and the figures under --figures.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from model.analysis import analyze_sequence
from weights.corpus import load_corpus
from weights.prepare import CACHE_DIR
from weights.tokenizer import GPT2Tokenizer
from weights.train import VOCAB_SIZE, gpt2_tokenizer_dir, token_stream, write_folder
from weights.trainer import TrainConfig, Trainer, TrainState

BASE = TrainConfig(n_embd=128, n_head=4, context=128, batch_size=16, steps=240, warmup_steps=24,
                   lr=1e-3, optimizer="adamw", eval_every=25, eval_windows=16)
DEPTHS = (6, 12)
ARCHITECTURES = ("pre-ln", "post-ln")
ANALYSIS_TEXTS = 8  # held-out windows whose attention is measured at each checkpoint
GRAD_EVERY = 25


def block_grad_norms(model: torch.nn.Module) -> list[float]:
    """‖∇θ‖₂ over each block's parameters."""
    return [
        math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in block.parameters() if p.grad is not None))
        for block in model.h
    ]


def layer_spectral_norms(model: torch.nn.Module, texts: list[list[int]]) -> list[float]:
    """Per layer, the mean over texts and heads of ‖A‖₂ (the /analyze/spectrum `mean`)."""
    was_training = model.training
    model.eval()
    layers = list(range(len(model.h)))
    norms = torch.stack([analyze_sequence(model, ids, "fast", layers, {"forward": 0.0, "spectral_norm": 0.0}).spectral_norm for ids in texts])  # [S, L, H]
    model.train(was_training)
    return norms.mean(dim=(0, 2)).tolist()


def run_one(
    config: TrainConfig, train_ids: np.ndarray, heldout_ids: np.ndarray, checkpoints: set[int]
) -> tuple[Trainer, TrainState, dict]:
    trainer = Trainer(config, train_ids, heldout_ids, VOCAB_SIZE)
    texts = [trainer.space.compact(w[:-1]).tolist() for w in trainer.eval_windows[:ANALYSIS_TEXTS]]
    grads, spectra = [], []

    def observe(step: int, model: torch.nn.Module) -> None:
        if step % GRAD_EVERY == 0:
            grads.append([step, block_grad_norms(model)])
        if step in checkpoints:
            spectra.append([step, layer_spectral_norms(model, texts)])

    state = trainer.run(observer=observe)
    spectra.append([state.step, layer_spectral_norms(trainer.model, texts)])
    trainer.record["heldout_loss"].append([state.step, trainer.heldout_nll(trainer.eval_windows)])
    result = {"record": trainer.record, "grad_norms": grads, "spectral_norms": spectra, "seconds": state.seconds,
              "diverged": state.diverged}
    return trainer, state, result


def summary(result: dict) -> dict:
    train_losses = [loss for _, loss, _ in result["record"]["train_loss"]]
    finite = all(math.isfinite(x) for x in train_losses)
    init_grads = result["grad_norms"][0][1]
    final_spectra = result["spectral_norms"][-1][1]
    return {
        "final_train_loss": float(np.mean(train_losses[-20:])) if finite else float("nan"),
        "final_heldout_loss": result["record"]["heldout_loss"][-1][1],
        "init_grad_last_over_first": init_grads[-1] / init_grads[0],
        "final_grad_last_over_first": result["grad_norms"][-1][1][-1] / result["grad_norms"][-1][1][0],
        "final_spectral_first": final_spectra[0],
        "final_spectral_last": final_spectra[-1],
        "final_spectral_range": [min(final_spectra), max(final_spectra)],
    }


def markdown_table(results: dict) -> str:
    lines = [
        "| run | train loss (last 20 steps) | held-out loss | block grad norm, last / first: at init | "
        "at the last record | mean ‖A‖₂ at the end, first → last layer (min–max) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, result in results.items():
        s = summary(result)
        low, high = s["final_spectral_range"]
        lines.append(
            f"| {name} | {s['final_train_loss']:.3f} | {s['final_heldout_loss']:.3f} | "
            f"{s['init_grad_last_over_first']:.2f} | {s['final_grad_last_over_first']:.3g} | {s['final_spectral_first']:.2f} → "
            f"{s['final_spectral_last']:.2f} ({low:.2f}–{high:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def draw(results: dict, figures: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    figures.mkdir(parents=True, exist_ok=True)
    colours = {"pre-ln": "tab:blue", "post-ln": "tab:red"}
    written = []
    panels = [(d, w) for d in DEPTHS for w in ("warm-up", "no warm-up")]

    def grid(title: str):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row", squeeze=False)
        fig.suptitle(title)
        return fig, [axes[i // 2][i % 2] for i in range(4)]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = figures / name
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        written.append(path)

    fig, axes = grid("Training (thin) and held-out (dots) loss, nats per token")
    for ax, (depth, warm) in zip(axes, panels):
        for arch in ARCHITECTURES:
            rec = results[f"{arch} {depth}L {warm}"]["record"]
            steps, losses, _ = zip(*rec["train_loss"])
            ax.plot(steps, losses, color=colours[arch], lw=0.6, alpha=0.6)
            hs, hl = zip(*rec["heldout_loss"])
            ax.plot(hs, hl, "o-", color=colours[arch], ms=3, label=f"{arch} held-out")
        ax.set_ylim(top=8.0)  # the first steps fall from log(V) ≈ 10.8; the rest is where runs differ
        ax.set_title(f"{depth} layers, {warm}")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    save(fig, "ln-loss.svg")

    def per_layer(key: str, title: str, name: str, log: bool) -> None:
        """One curve per recorded checkpoint (later ones darker), first and last labelled."""
        fig, axes = grid(title)
        for ax, (depth, warm) in zip(axes, panels):
            for arch in ARCHITECTURES:
                series = results[f"{arch} {depth}L {warm}"][key]
                if key == "grad_norms":  # recorded every GRAD_EVERY steps: draw first, middle, last
                    series = [series[0], series[len(series) // 2], series[-1]]
                for i, (step, values) in enumerate(series):
                    ax.plot(range(depth), values, "o-", color=colours[arch], ms=3,
                            alpha=0.3 + 0.7 * i / max(1, len(series) - 1),
                            label=f"{arch}, step {step}" if i in (0, len(series) - 1) else None)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{depth} layers, {warm}")
            ax.set_xlabel("layer")
            ax.legend(fontsize=8)
        save(fig, name)

    per_layer("grad_norms", "Gradient norm of each block before clipping, from initialisation (light) to the end (dark)",
              "ln-grad-norms.svg", log=True)
    per_layer("spectral_norms", "Mean attention spectral norm ‖A‖₂ per layer on held-out texts, by checkpoint",
              "ln-spectral-norms.svg", log=False)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/ln-experiment"))
    parser.add_argument("--figures", type=Path, default=Path("docs/figures"))
    parser.add_argument("--steps", type=int, default=BASE.steps)
    parser.add_argument("--seed", type=int, default=BASE.seed)
    args = parser.parse_args(argv)
    base = replace(BASE, steps=args.steps, seed=args.seed, warmup_steps=min(BASE.warmup_steps, args.steps))
    train_works, heldout_works = load_corpus(CACHE_DIR)
    tokenizer = GPT2Tokenizer.from_dir(gpt2_tokenizer_dir())
    train_ids, heldout_ids = token_stream(train_works, tokenizer), token_stream(heldout_works, tokenizer)
    checkpoints = {0, base.steps // 3, 2 * base.steps // 3}
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for depth in DEPTHS:
        for warm in ("warm-up", "no warm-up"):
            for arch in ARCHITECTURES:
                name = f"{arch} {depth}L {warm}"
                print(f"== {name}", flush=True)
                config = replace(base, architecture=arch, n_layer=depth,
                                 warmup_steps=base.warmup_steps if warm == "warm-up" else 0)
                trainer, state, results[name] = run_one(config, train_ids, heldout_ids, checkpoints)
                if depth == max(DEPTHS) and warm == "warm-up":
                    write_folder(args.out / f"{arch}-{depth}L", trainer, state, trainer.record)
                (args.out / "results.json").write_text(json.dumps(results) + "\n")
    # The texts the spectra were measured on, for `gpt2-analyze` on the written pair.
    texts = [tokenizer.decode(w[:-1].tolist()) for w in trainer.eval_windows[:ANALYSIS_TEXTS]]
    (args.out / "heldout_texts.json").write_text(json.dumps(texts, indent=1) + "\n")
    table = markdown_table(results)
    (args.out / "results.md").write_text(table)
    print(table)
    for path in draw(results, args.figures):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
