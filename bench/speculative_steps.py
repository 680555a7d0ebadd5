"""Engine steps to serve a batch with n-gram speculation on and off, the core's overlap on (as on
CUDA): how many steps the drafters' sitting out costs (service/engine/draft_policy.py). Steps, not
seconds: on a GPU a decode step's time hardly depends on its rows at these batch sizes, so the
step count is what the clients wait for there; it is the same on any device.

    .venv/bin/python -m bench.speculative_steps                      # 16 clients, 96 tokens, random 124M
    .venv/bin/python -m bench.speculative_steps --clients 64 --new-tokens 128 --device cuda

Each configuration runs in a fresh in-process engine (service/inprocess.py), every request
submitted at once: sampled (temperature 1, seeded: text with few n-gram matches) and greedy.
Printed per configuration: steps, tokens, tokens per step; and whether speculation kept every
request's tokens (it must: "same tokens").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import describe_machine
from service.engine.ngram_drafter import NgramSettings
from service.engine.types import GenerationRequest, SamplingParams
from service.inprocess import Engine, EngineConfig
from weights.checkpoint import load_model
from weights.tokenizer import GPT2Tokenizer


def steps_to_serve(engine: Engine, prompts: list[list[int]], new_tokens: int, sampled: bool) -> tuple[int, dict]:
    """(steps, each request's token ids) once every request is done."""
    engine.submit([GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                                                     do_sample=sampled, seed=i if sampled else None),
                                     time.monotonic()) for i, prompt in enumerate(prompts)])
    steps, outputs = 0, {}
    while engine.has_work():
        outputs.update((f.request_id, f.sequences[0].token_ids) for f in engine.step().finished)
        steps += 1
    return steps, outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    model = load_model(args.model_dir, device=torch.device(args.device))
    tokenizer = GPT2Tokenizer.from_dir(args.model_dir)
    prompts = [tokenizer.encode(f"Client {i} asks about the weather in town {i}") for i in range(args.clients)]
    print(describe_machine(), args.device)
    print(f"{args.clients} clients, {args.new_tokens} new tokens each, overlap on; {args.model_dir}")
    for sampled in (True, False):
        outputs = []
        for speculative in (NgramSettings(), None):
            engine = Engine(model, tokenizer, EngineConfig(max_slots=args.clients, overlap=True, speculative=speculative))
            steps, tokens = steps_to_serve(engine, prompts, args.new_tokens, sampled)
            outputs.append(tokens)
            count = sum(map(len, tokens.values()))
            label = f"{'sampled' if sampled else 'greedy'}, speculation {'on' if speculative else 'off'}"
            print(f"{label:26s} {steps:5d} steps {count:6d} tokens {count / steps:6.2f} tokens a step")
        print("same tokens" if outputs[0] == outputs[1] else "TOKENS DIFFER")


if __name__ == "__main__":
    main()
