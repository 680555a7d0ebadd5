"""Which training recipe and model size learn most on this machine (weights/train.py's default).

    python -m bench.train_recipes --steps 100 "adamw lr=1e-3" "muon optimizer=muon,lr=2e-3"
    python -m bench.train_recipes --minutes 12 "6x256 optimizer=muon" "4x192 n_layer=4,n_embd=192,n_head=3,optimizer=muon"

Each candidate is a name and TrainConfig overrides (key=value, comma-separated) on top of the
default. With --steps every candidate trains that many steps (cosine schedule over them, warm-up
10%); with --minutes each is first timed for a few steps and then given as many steps as fit in
that budget at its pace, so sizes compete on equal machine time. Every candidate is scored on the
same held-out windows of the Shakespeare corpus (nats per token, full vocabulary); candidates run
one after another, on a machine assumed idle.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields, replace

from bench.common import add_smoke_argument
from weights.corpus import load_corpus
from weights.prepare import CACHE_DIR
from weights.tokenizer import GPT2Tokenizer
from weights.train import VOCAB_SIZE, gpt2_tokenizer_dir, token_stream
from weights.trainer import TrainConfig, Trainer

PACE_STEPS = 3
EVAL_WINDOWS = 32


def parse_candidate(text: str) -> tuple[str, dict]:
    name, _, overrides = text.partition(" ")
    types = {f.name: type(f.default) for f in fields(TrainConfig)}
    changes = {}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"{key!r} is not a TrainConfig field ({', '.join(types)})")
        changes[key] = types[key](value)
    return name, changes


def seconds_per_step(config: TrainConfig, train_ids, heldout_ids) -> float:
    """Whole steps only: the observer runs at the same point of every step, so the time between
    its calls at steps 1 and PACE_STEPS + 1 is PACE_STEPS steps (step 0 pays one-off allocation)."""
    pace = Trainer(replace(config, steps=PACE_STEPS + 2, warmup_steps=1, eval_every=10**9), train_ids, heldout_ids, VOCAB_SIZE)
    seen = []
    pace.run(observer=lambda step, model: seen.append(time.perf_counter()), progress=False)
    return (seen[PACE_STEPS + 1] - seen[1]) / PACE_STEPS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="the same number of steps for every candidate")
    budget.add_argument("--minutes", type=float, help="the same training time for every candidate")
    parser.add_argument("candidates", nargs="+", help='"name key=value,key=value"')
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    train_works, heldout_works = load_corpus(CACHE_DIR)
    if args.smoke:  # one work each: tokenizing the whole corpus takes longer than a smoke run's training
        train_works, heldout_works = train_works[:1], heldout_works[:1]
    tokenizer = GPT2Tokenizer.from_dir(gpt2_tokenizer_dir())
    train_ids, heldout_ids = token_stream(train_works, tokenizer), token_stream(heldout_works, tokenizer)
    rows = []
    for name, changes in map(parse_candidate, args.candidates):
        config = replace(TrainConfig(), **{"eval_windows": EVAL_WINDOWS, **changes})
        steps = args.steps or int(args.minutes * 60 / seconds_per_step(config, train_ids, heldout_ids))
        config = replace(config, steps=steps, warmup_steps=max(1, steps // 10), eval_every=max(1, steps // 4))
        trainer = Trainer(config, train_ids, heldout_ids, VOCAB_SIZE)
        state = trainer.run(progress=False)
        heldout = trainer.heldout_nll(trainer.eval_windows)
        train_tail = trainer.record["train_loss"][-10:]
        rows.append((name, config, state.seconds, sum(x[1] for x in train_tail) / len(train_tail), heldout))
        print(f"{name}: {steps} steps in {state.seconds:.0f} s, held-out {heldout:.4f}", flush=True)
    print("\n| candidate | layers x width, batch | optimizer, lr | steps | seconds | train loss (last 10) | held-out (windows) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, c, seconds, train, heldout in rows:
        print(f"| {name} | {c.n_layer}x{c.n_embd}, {c.batch_size} | {c.optimizer}, {c.lr:g} | {c.steps} | {seconds:.0f} | {train:.3f} | {heldout:.3f} ({c.eval_windows}) |")


if __name__ == "__main__":
    main()
