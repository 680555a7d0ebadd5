"""Differential fuzzing of the batch-invariance promise (docs/batch-invariance.md, issue 31).

A case is one target request, the neighbours that share the engine with it (arriving with it,
before or after it, some cancelled, some sharing its prompt's prefix, which the prefix cache then
hands it), and the engine's speed features. The target runs alone in a fresh engine, then among
its neighbours in another fresh engine with the same features but, in two cases of three,
another prefill budget (so its prompt is cut into other chunks): on CPU every sequence must come
back identical (tokens, text, log-probs and alternatives to the bit, prompt scores, beam
scores). With speculation on, the lone run must also equal the one without speculation. A
failure is shrunk (neighbours dropped, parameters reset) and printed as JSON.

    python -m tests.engine.invariance_fuzz --cases 10000      # make fuzz-invariance
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from model.config import GPT2Config
from service.engine.ngram_drafter import NgramSettings
from service.engine.types import MAX_BAD_WORDS, GenerationRequest, SamplingParams
from service.inprocess import Engine, EngineConfig

# The tiny model's shape, with a 2,048-wide MLP: from about 1,536 inputs oneDNN gives a lone row
# a product kernel of its own (model/linear.py), so the fuzz model runs that path as GPT-2 does.
FUZZ_CONFIG = GPT2Config(vocab_size=50257, n_positions=160, n_embd=64, n_layer=2, n_head=4, n_inner=2048)
# GPT-2's initialisation gives a tiny model logits of ~0.1, whose last-bit changes round away in
# log-probs of ~-10.8; embeddings 30 times larger spread them as a trained model's are, and then
# a row computed in another order shows (measured: 2 of 12 cases caught a lone-row kernel, 0 before).
EMBEDDING_SCALE = 30.0
MAX_SLOTS = 24
STOPS = ("e", " the", "a", ".", "\n", "ing", "!")
# Constrained decoding (llguidance's grammar text, as the HTTP side builds it): a regex, a choice,
# a small JSON schema.
GRAMMARS = (
    '%llguidance {}\nstart: /[a-z ]{1,20}/',
    '%llguidance {}\nstart: "yes" | "no" | "maybe not"',
    '%llguidance {}\nstart: %json {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},'
    ' "required": ["a"], "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}',
)
# What a grammar cannot be combined with (service/engine/validation.py refuses it).
NOT_WITH_GRAMMAR = ("ignore_eos", "min_new_tokens", "stop_token_ids", "no_repeat_ngram_size", "bad_words_ids")


@dataclass(frozen=True)
class Features:
    speculative: bool = False
    prefix_caching: bool = False
    max_prefill_tokens: int = 512
    # The lone run's prefill budget (None: max_prefill_tokens): another budget cuts the target's
    # prompt into other chunks than among its neighbours.
    lone_prefill_tokens: int | None = None
    quantize: str = "none"
    threads: int = 1
    # The core's overlap (launch a step before reading the last one's tokens) among neighbours;
    # the lone run never overlaps, so a case also checks that overlap changes nothing.
    overlap: bool = False


def pick(rng: random.Random, *choices):
    return rng.choice(choices)


def random_prompt(rng: random.Random, vocab: int) -> list[int]:
    length = pick(rng, 1, 2, 5, 12, 30, 60)
    if rng.random() < 0.3:  # a repeating pattern: n-gram drafts find something to propose
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        return (pattern * length)[:length]
    return [rng.randrange(vocab) for _ in range(length)]


def random_params(rng: random.Random, vocab: int) -> dict:
    """Settings any engine client may send, as SamplingParams keyword arguments (JSON values)."""
    p: dict = {"max_new_tokens": rng.randint(1, 12)}
    kind = pick(rng, "greedy", "sample", "sample", "sample", "beam")
    if kind == "beam":
        beams = rng.randint(2, 3)
        p.update(num_beams=beams, num_return_sequences=rng.randint(1, beams),
                 length_penalty=pick(rng, 1.0, 0.5, -1.0), early_stopping=pick(rng, False, True, "never"))
    elif kind == "sample":
        p.update(do_sample=True, seed=rng.randrange(2**31), temperature=pick(rng, 0.5, 1.0, 1.2, 2.0),
                 top_k=pick(rng, 0, 0, 1, 5, 200), top_p=pick(rng, 1.0, 1.0, 0.5, 0.8, 0.95),
                 typical_p=pick(rng, 1.0, 1.0, 0.2, 0.8, 0.95), min_p=pick(rng, 0.0, 0.0, 0.05, 0.3),
                 num_return_sequences=pick(rng, 1, 1, 1, 2, 3))
    if rng.random() < 0.3:
        p["repetition_penalty"] = pick(rng, 1.3, 0.8)
    if kind != "beam":
        if rng.random() < 0.2:
            p.update(presence_penalty=pick(rng, 0.5, -0.5), frequency_penalty=pick(rng, 0.0, 0.3))
        if rng.random() < 0.15:
            p["no_repeat_ngram_size"] = pick(rng, 1, 2, 3)
        if rng.random() < 0.15:
            p["bad_words_ids"] = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.15:  # distinct ids: repeated ones are logit_bias's own question
            p["logit_bias"] = [[t, rng.uniform(-5, 5)] for t in rng.sample(range(vocab), rng.randint(1, 4))]
        if rng.random() < 0.15:
            p.update(min_new_tokens=rng.randint(1, 5), stop_token_ids=[rng.randrange(vocab)])
        if rng.random() < 0.3:
            p["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.1:
            p["speculate"] = False
    if rng.random() < 0.25:
        p["top_logprobs"] = rng.randint(1, 5)
    if rng.random() < 0.1:
        p["prompt_logprobs"] = True
    if rng.random() < 0.1:
        p["ignore_eos"] = True
    if kind != "beam" and rng.random() < 0.15:
        p["grammar"] = pick(rng, *GRAMMARS)
        for key in NOT_WITH_GRAMMAR:
            p.pop(key, None)
    return p


def random_case(rng: random.Random, features: list[Features], vocab: int = FUZZ_CONFIG.vocab_size) -> dict:
    feature = rng.choice(features)
    target = {"prompt": random_prompt(rng, vocab), "params": random_params(rng, vocab), "arrives": 0}
    neighbours = []
    for _ in range(pick(rng, 0, 1, 2, 3, 5, 8, 23)):
        prompt = random_prompt(rng, vocab)
        if rng.random() < 0.3:  # the target's prompt's prefix: with prefix caching, one may hand it its keys
            prompt = target["prompt"][: rng.randint(1, len(target["prompt"]))] + prompt
        neighbours.append({"prompt": prompt[:100], "params": random_params(rng, vocab),
                           "arrives": pick(rng, 0, 0, 0, 1, 3), "cancel_at": pick(rng, None, None, None, None, 2, 5)})
    target["arrives"] = pick(rng, 0, 0, 1, 2)
    return {"features": asdict(feature), "target": target, "neighbours": neighbours}


def sampling_params(spec: dict) -> SamplingParams:
    p = dict(spec)
    for key in ("stop", "stop_token_ids"):
        if key in p:
            p[key] = tuple(p[key])
    for key in ("bad_words_ids", "logit_bias"):
        if key in p:
            p[key] = tuple(tuple(item) for item in p[key][:MAX_BAD_WORDS])
    return SamplingParams(**p)


class Models:
    """The fuzz model folder, loaded once per quantization."""

    def __init__(self, model_dir: Path, device: torch.device) -> None:
        from weights.checkpoint import load_model
        from weights.tokenizer import GPT2Tokenizer

        self._load, self.model_dir, self.device = load_model, model_dir, device
        self.tokenizer = GPT2Tokenizer.from_dir(model_dir)
        self._models: dict[str, object] = {}

    def get(self, quantize: str):
        if quantize not in self._models:
            model = self._load(self.model_dir, device=self.device)
            if quantize != "none":
                model.quantize(quantize)
            self._models[quantize] = model
        return self._models[quantize]


def run_engine(models: Models, features: dict, entries: list[dict]) -> dict[str, dict]:
    """Each entry's result, keyed by its id; entries arrive at their step, some are cancelled."""
    f = Features(**features)
    config = EngineConfig(
        max_slots=MAX_SLOTS, max_waiting=128, prefix_caching=f.prefix_caching, max_prefill_tokens=f.max_prefill_tokens,
        speculative=NgramSettings() if f.speculative else None,  # priced by the batch: drafts vary with it
        overlap=f.overlap,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(f.threads)
    try:
        engine = Engine(models.get(f.quantize), models.tokenizer, config)
        results: dict[str, dict] = {}
        step, waits = 0, 0
        while step < 2000:
            if not waits:  # the step's arrivals and cancellations, once
                arriving = [e for e in entries if e["arrives"] == step]
                if arriving:
                    engine.submit([GenerationRequest(e["id"], e["prompt"], sampling_params(e["params"]), 0.0) for e in arriving])
                for e in entries:
                    if e.get("cancel_at") == step and e["id"] not in results and e["arrives"] < step:
                        engine.cancel(e["id"])
            output = engine.step()
            if output.failed:
                raise RuntimeError(output.failed[0].message)
            results.update((r.request_id, outcome(r)) for r in output.finished)
            if len(results) == len(entries) and not engine.has_work():
                return results
            # A step that computed nothing waits on a grammar compiling on its own thread (hundreds
            # of such steps, more under load): it is not a step of the case, and the compile
            # wants the GIL this loop would hold.
            if idle(output) and engine.has_work() and waits < IDLE_WAITS:
                waits += 1
                time.sleep(0.001)
                continue
            step, waits = step + 1, 0
        raise AssertionError("the engine did not finish")
    finally:
        torch.set_num_threads(threads)


IDLE_WAITS = 10_000  # 1 ms each: a compile under load may take seconds, not this long


def idle(output) -> bool:
    return not (output.events or output.finished or output.stats.counted_anything())


def outcome(result) -> dict:
    """Everything a client sees of a request, timings aside."""
    return {
        "sequences": [(s.token_ids, s.text, s.logprobs, s.finish_reason, s.score, s.top_logprobs) for s in result.sequences],
        "prompt_scores": None if result.prompt_scores is None else asdict(result.prompt_scores),
        "seed": result.seed,
    }


def failure(models: Models, case: dict) -> str | None:
    """Why the case breaks the promise, or None."""
    target = dict(case["target"], id="target", arrives=0)
    lone = dict(case["features"], overlap=False)
    lone["max_prefill_tokens"] = lone.pop("lone_prefill_tokens", None) or lone["max_prefill_tokens"]
    alone = run_engine(models, lone, [target])["target"]
    if case["features"]["speculative"]:
        plain = run_engine(models, dict(lone, speculative=False), [target])["target"]
        if plain != alone:
            return f"speculation changed the lone request: {difference(plain, alone)}"
    entries = [dict(case["target"], id="target")] + [dict(n, id=f"n{i}") for i, n in enumerate(case["neighbours"])]
    shared = run_engine(models, case["features"], entries)["target"]
    if shared != alone:
        return f"alone and among neighbours differ: {difference(alone, shared)}"
    return None


def difference(a: dict, b: dict) -> str:
    for index, (x, y) in enumerate(zip(a["sequences"], b["sequences"])):
        first = next((i for i, (s, t) in enumerate(zip(x[0], y[0])) if s != t), None)
        if x != y:
            return f"sequence {index}: tokens {x[0]} vs {y[0]} (first differing at {first}), logprobs {x[2]} vs {y[2]}"
    return f"{a} vs {b}"


def shrink(models: Models, case: dict) -> dict:
    """A smaller case that still fails: neighbours dropped, then parameters reset to defaults."""
    def fails(candidate: dict) -> bool:
        return failure(models, candidate) is not None

    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(case["neighbours"]))):
            smaller = dict(case, neighbours=case["neighbours"][:i] + case["neighbours"][i + 1 :])
            if fails(smaller):
                case, changed = smaller, True
        for who in ["target"] + list(range(len(case["neighbours"]))):
            spec = case["target"] if who == "target" else case["neighbours"][who]
            # An unseeded sampled request draws another seed in every engine: never reset "seed".
            for key in [k for k in spec["params"] if k not in ("max_new_tokens", "seed")]:
                simpler_spec = dict(spec, params={k: v for k, v in spec["params"].items() if k != key})
                if who == "target":
                    simpler = dict(case, target=simpler_spec)
                else:
                    simpler = dict(case, neighbours=[simpler_spec if j == who else n for j, n in enumerate(case["neighbours"])])
                try:
                    if fails(simpler):
                        case, spec, changed = simpler, simpler_spec, True
                except ValueError:  # the reset made an invalid request (e.g. n > 1 without sampling)
                    pass
    return case


def write_fuzz_model(out_dir: Path) -> Path:
    from tests.conftest import DEFAULT_MODEL_DIR, perturbed_state
    from weights.random_init import write_model_dir

    state = perturbed_state(FUZZ_CONFIG)
    for name in [name for name in state if name.endswith("wte.weight")]:
        state[name] = state[name] * EMBEDDING_SCALE
    write_model_dir(out_dir, FUZZ_CONFIG, state, prefixed=True)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (out_dir / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    return out_dir


def cpu_features() -> list[Features]:
    """Every speed feature on and off, several prefill chunk sizes (the lone run's the same or
    another), float32 and int8, 1 and 2 threads, overlap on and off."""
    from model.quantized import quantize_problem

    quantized = ["none"] + (["int8"] if quantize_problem("int8", "cpu", torch.float32) is None else [])
    return [
        Features(speculative=s, prefix_caching=c, max_prefill_tokens=chunk, lone_prefill_tokens=lone, quantize=q,
                 threads=t, overlap=o)
        for s in (False, True) for c in (False, True) for chunk in (512, 16, 5) for lone in (None, 512, 16, 5)
        for q in quantized for t in (1, 2) for o in (False, True) if lone != chunk
    ]


def fuzz(models: Models, cases: int, seed: int, features: list[Features], out=sys.stdout, skip: int = 0) -> list[dict]:
    """Run `cases` random cases, the first `skip` drawn but not run (a run resumed); print and
    return the shrunk reproducer of each failure."""
    rng = random.Random(seed)
    found = []
    for index in range(cases):
        case = random_case(rng, features)
        if index < skip:
            continue
        reason = failure(models, case)
        if reason is not None:
            small = shrink(models, case)
            found.append(small)
            print(f"case {index} (seed {seed}) FAILED: {failure(models, small) or reason}\n"
                  f"reproducer: {json.dumps(small)}", file=out, flush=True)
        if (index + 1) % 100 == 0:
            print(f"{index + 1} cases, {len(found)} failures", file=out, flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    parser.add_argument("--skip", type=int, default=0, help="resume a run: draw its first SKIP cases without running them")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    with tempfile.TemporaryDirectory() as folder:
        models = Models(write_fuzz_model(Path(folder)), torch.device("cpu"))
        started = time.monotonic()
        print(f"fuzzing {args.cases} cases from seed {seed}" + (f", from case {args.skip}" if args.skip else ""), flush=True)
        found = fuzz(models, args.cases, seed, cpu_features(), skip=args.skip)
    print(f"{args.cases} cases, {len(found)} failures, {time.monotonic() - started:.0f} s")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
