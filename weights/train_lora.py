"""Fine-tune a model folder with LoRA on a slice of the Shakespeare corpus; write a peft adapter.

    python -m weights.train_lora [--base weights/shakespeare-histories-tragedies] [--out weights/lora-poems]
                                 [--slice poems|comedies] [--rank 16] [--alpha 32] [--steps 150] [--lr 2e-3] [--seed 0]

The base stays frozen; only each block's LoRA A and B (c_attn, c_proj, c_fc) are trained, through
the model's own adapter path (model/lora.py, the code that serves them) and weights/trainer.py's
loop. The slice's works that `weights.train` held out (Lover's Complaint for the poems, Twelfth
Night for the comedies) are the held-out text here too, so neither the base nor the adapter has
seen it. The base should not have seen the slice's other works either (`python -m weights.train
--leave-out poems --leave-out comedies` trains one on the histories and tragedies alone): on a base
trained on them, an adapter adds little more than further training, and this says so when it
starts. The folder is peft's (`adapter_config.json`, `adapter_model.safetensors`, loadable by
peft's PeftModel on transformers' GPT2LMHeadModel) plus LORA_TRAINING.json: the held-out loss
before (the base) and after, in nats per token over every held-out token, and how much lower
with a 95% interval paired over the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from model.lora import LoraSet
from model.lora_format import LoraAdapter, SiteWeights, adapter_config, read_adapter, write_adapter
from weights.checkpoint import load_model
from weights.corpus import HELD_OUT, SLICES, load_corpus
from weights.prepare import CACHE_DIR
from weights.tokenizer import GPT2Tokenizer
from weights.train import token_stream
from weights.trainer import TokenSpace, TrainConfig, Trainer, heldout_windows

REPO_WEIGHTS = Path(__file__).resolve().parent
RECORD_FILE = "LORA_TRAINING.json"
TARGET_MODULES = ["c_attn", "c_proj", "c_fc"]


def embedding_space(embedding: torch.Tensor) -> TokenSpace:
    """The base's own token space: tokens whose embedding row is the most common row share it (a
    model weights.train wrote gives every token its training text lacked one shared row), every
    other token has its own. Scoring over these rows is the full-vocabulary softmax, exactly."""
    _, inverse, counts = torch.unique(embedding, dim=0, return_inverse=True, return_counts=True)
    own_rows = (inverse != counts.argmax()).nonzero()[:, 0]
    return TokenSpace(own_rows.numpy(), embedding.shape[0])


class AdaptedModel(nn.Module):
    """The frozen base with one trainable adapter, as the trainer's loop calls a model."""

    def __init__(self, base: nn.Module, space: TokenSpace, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        embedding = base.tied_embedding.detach()
        shared = int(np.setdiff1d(np.arange(space.vocab_size), space.kept)[0])
        # The trainer speaks compact ids (the base's own rows, then the shared one): the full id
        # of each, which the base embeds (the shared row's tokens all embed alike), and the head.
        self.register_buffer("full_id", torch.cat([torch.from_numpy(space.kept), torch.tensor([shared])]))
        self.register_buffer("compact_embedding", embedding[self.full_id])
        self.lora_a, self.lora_b = nn.ParameterDict(), nn.ParameterDict()
        sites = {}
        for name, module in base.h.named_modules():
            if name.rsplit(".", 1)[-1] in TARGET_MODULES:
                n_in, n_out = module.weight.shape
                a = torch.empty(rank, n_in)
                # peft's initialisation: A as nn.Linear's default, B zero (the start is the base).
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
                key = name.replace(".", "/")
                self.lora_a[key], self.lora_b[key] = nn.Parameter(a), nn.Parameter(torch.zeros(n_out, rank))
                sites[f"h.{name}"] = SiteWeights(self.lora_a[key], self.lora_b[key], alpha / rank)
        self.adapters = LoraSet(base)
        self.index = self.adapters.add("training", LoraAdapter(sites, config={}))

    @property
    def tied_embedding(self) -> torch.Tensor:
        return self.compact_embedding

    def forward(self, input_ids: torch.Tensor, apply_head: bool = True):
        return self.base(self.full_id[input_ids], apply_head=apply_head, lora=self.adapters.rows([self.index] * len(input_ids)))

    def site_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {f"h.{key.replace('/', '.')}": (self.lora_a[key], self.lora_b[key]) for key in self.lora_a}


class LoraTrainer(Trainer):
    """weights.trainer's loop over a frozen base: AdamW on the adapter's A and B only."""

    def __init__(self, config: TrainConfig, base: nn.Module, train_ids: np.ndarray, heldout_ids: np.ndarray,
                 rank: int, alpha: float) -> None:
        self.base, self.rank, self.alpha = base, rank, alpha
        super().__init__(config, train_ids, heldout_ids, base.config.vocab_size)

    def token_space(self, train_ids: np.ndarray, vocab_size: int) -> TokenSpace:
        return embedding_space(self.base.tied_embedding.detach())

    def build_model(self) -> nn.Module:
        self.model_config = self.base.config
        return AdaptedModel(self.base, self.space, self.rank, self.alpha, torch.Generator().manual_seed(self.config.seed))

    def optimizers(self) -> list[torch.optim.Optimizer]:
        trained = [p for p in self.model.parameters() if p.requires_grad]
        return [torch.optim.AdamW(trained, lr=self.config.lr, betas=(0.9, 0.999), weight_decay=0.0, foreach=True)]


def slice_streams(slice_name: str, tokenizer: GPT2Tokenizer) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """(training tokens, held-out tokens, their works' names) of a slice."""
    train_works, heldout_works = load_corpus(CACHE_DIR, HELD_OUT)
    works = SLICES[slice_name]
    train = [w for w in train_works if w.name in works]
    heldout = [w for w in heldout_works if w.name in works]
    return token_stream(train, tokenizer), token_stream(heldout, tokenizer), [w.name for w in train], [w.name for w in heldout]


def fine_tune(base_dir: Path, out: Path, train_ids: np.ndarray, heldout_ids: np.ndarray, rank: int = 16,
              alpha: float = 32.0, steps: int = 150, seed: int = 0, batch_size: int = 8, lr: float = 2e-3,
              context: int | None = None, progress: bool = True, about: dict | None = None) -> dict:
    """Train an adapter of base_dir's model on train_ids; write it to `out` with its record (held-out
    loss before and after over every token of heldout_ids, nats per token; `about` added to it)."""
    base = load_model(base_dir)
    base.prepare(use_packed=False)  # F.linear: products autograd can differentiate
    context = context or min(256, base.config.n_positions)
    config = TrainConfig(context=context, batch_size=batch_size, steps=steps, lr=lr, min_lr=lr / 10,
                         warmup_steps=max(1, steps // 10), optimizer="adamw", seed=seed,
                         eval_every=max(1, steps // 3), eval_windows=16)
    trainer = LoraTrainer(config, base, train_ids, heldout_ids, rank, alpha)
    every_window = heldout_windows(heldout_ids, context)
    before = trainer.heldout_token_nll(every_window)
    state = trainer.run(progress=progress)
    after = trainer.heldout_token_nll(every_window)
    margin = paired_margin(before, after)
    record = trainer.record | {
        "base": str(base_dir), "rank": rank, "alpha": alpha, "target_modules": TARGET_MODULES,
        "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids), "steps_done": state.step,
        "seconds": round(state.seconds, 1), "threads": torch.get_num_threads(),
        "heldout_loss_before": margin.pop("before"), "heldout_loss_after": margin.pop("after"),
        "heldout_margin": margin, "base_trained_on": base_training_works(base_dir), "config": asdict(config),
        **(about or {}),
    }
    write_adapter(out, trainer.model.site_tensors(), adapter_config(rank, alpha, TARGET_MODULES, base_model=str(base_dir)))
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    read_adapter(out, base.config)  # what was written must load as it will be served
    return record


def paired_margin(before: list[torch.Tensor], after: list[torch.Tensor]) -> dict:
    """The held-out loss before and after, and how much lower after is (nats per token) with a 95%
    interval. The same tokens are scored twice, so the interval is the paired difference's; its
    standard error treats each window as one draw (tokens within a window are not independent)."""
    differences = [(b - a).double() for b, a in zip(before, after)]
    count = sum(len(d) for d in differences)
    mean = float(sum(d.sum() for d in differences)) / count
    # Cluster-robust standard error of a mean: the windows' summed deviations from it.
    spread = sum(float((d - mean).sum()) ** 2 for d in differences)
    error = math.sqrt(len(differences) / max(len(differences) - 1, 1) * spread) / count
    return {
        "before": float(sum(b.double().sum() for b in before)) / count,
        "after": float(sum(a.double().sum() for a in after)) / count,
        "mean": mean, "low": mean - 1.96 * error, "high": mean + 1.96 * error,
        "windows": len(differences), "tokens": count,
    }


def base_training_works(base_dir: Path) -> list[str] | None:
    """The works the base was trained on, as weights.train recorded them (None: not recorded)."""
    record = base_dir / "TRAINING.json"
    if not record.exists():
        return None
    return json.loads(record.read_text()).get("corpus", {}).get("train_works")


def train_lora(base_dir: Path, out: Path, slice_name: str = "poems", **options) -> dict:
    """`fine_tune` on a slice of the corpus."""
    tokenizer = GPT2Tokenizer.from_dir(base_dir)
    train_ids, heldout_ids, train_names, heldout_names = slice_streams(slice_name, tokenizer)
    print(f"slice {slice_name}: {len(train_names)} works, {len(train_ids):,} tokens for training; held out "
          f"{', '.join(heldout_names)}: {len(heldout_ids):,} tokens", file=sys.stderr)
    seen = sorted(set(base_training_works(base_dir) or ()) & set(train_names))
    if seen:
        print(f"note: the base was trained on {len(seen)} of the slice's {len(train_names)} works ({', '.join(seen)}): "
              "the adapter's margin then measures little more than further training (a base trained with "
              f"--leave-out {slice_name} leaves it something to learn)", file=sys.stderr)
    about = {"slice": slice_name, "train_works": train_names, "heldout_works": heldout_names}
    return fine_tune(base_dir, out, train_ids, heldout_ids, about=about, **options)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=REPO_WEIGHTS / "shakespeare-histories-tragedies")
    parser.add_argument("--out", type=Path, default=None, help="default: weights/lora-SLICE")
    parser.add_argument("--slice", choices=sorted(SLICES), default="poems")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate (cosine decay to a tenth)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.base / "config.json").exists():
        sys.exit(f"{args.base}: no model folder (python -m weights.train --out {args.base} trains one)")
    out = args.out or REPO_WEIGHTS / f"lora-{args.slice}"
    started = time.perf_counter()
    record = train_lora(args.base, out, args.slice, rank=args.rank, alpha=args.alpha, steps=args.steps,
                        lr=args.lr, seed=args.seed)
    print(f"wrote {out} after {record['steps_done']} steps in {time.perf_counter() - started:.0f} s")
    print(f"held-out loss on {', '.join(record['heldout_works'])} ({record['heldout_tokens']:,} tokens), nats per token:")
    margin = record["heldout_margin"]
    print(f"  base          {record['heldout_loss_before']:.4f}")
    print(f"  base + LoRA   {record['heldout_loss_after']:.4f}")
    print(f"  lower by      {margin['mean']:.4f} (95% interval {margin['low']:.4f} to {margin['high']:.4f}, "
          f"paired over {margin['windows']} windows)")


if __name__ == "__main__":
    main()
