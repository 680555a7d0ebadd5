"""Which grammar engine constrains our decoding: llguidance, xgrammar and outlines-core, measured
side by side on GPT-2's vocabulary, for the structured-output issue's choice.

    .venv/bin/pip install llguidance xgrammar outlines-core     # the candidates (one is kept)
    .venv/bin/python -m bench.grammar_engines                    # ~1 min per engine on 2 cores

For each engine and each of a handful of JSON schemas as API users send them (bench/grammar_schemas.py:
10 to 20 properties, nested objects and arrays, enums, anyOf, string formats, bounded numbers):
- compile: from the schema text to the first token mask of a fresh matcher (cold: nothing cached),
  and again from the engine's own reuse path (cached: a copy of a compiled matcher, a cache hit);
- mask: rows each following a valid instance of one schema token by token, every step filling
  each row's allowed-token bitmask and consuming its next token, at 1, 16 and 64 rows: CPU µs
  per row per step (one thread: the step loop's own; a token mask costs the same on a GPU host).
Also printed: whether every instance's tokens were accepted to the end (an engine that refuses a
valid instance is wrong for it), and each engine's extra dependencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import add_smoke_argument, describe_machine
from bench.grammar_schemas import SCHEMAS
from weights.tokenizer import GPT2Tokenizer

ENGINES = ("llguidance", "xgrammar", "outlines-core")


@dataclass
class Vocab:
    tokenizer: GPT2Tokenizer
    tokenizer_json: str
    byte_level: list[str]  # token id → its string in the vocabulary (GPT-2's byte-to-unicode form)
    eos: int

    @classmethod
    def load(cls, model_dir: Path) -> "Vocab":
        tokenizer = GPT2Tokenizer.from_dir(model_dir)
        vocab = json.loads((model_dir / "vocab.json").read_text())
        byte_level = [""] * len(vocab)
        for token, index in vocab.items():
            byte_level[index] = token
        return cls(tokenizer, (model_dir / "tokenizer.json").read_text(), byte_level, tokenizer.eos_token_id)

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes (the inverse of GPT-2's byte-to-unicode table)."""
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        table, extra = {}, 0
        for byte in range(256):
            if byte in printable:
                table[chr(byte)] = byte
            else:
                table[chr(256 + extra)] = byte
                extra += 1
        return [bytes(table[ch] for ch in token) for token in self.byte_level]


class Matcher:
    """One row's constraint: fill its bitmask row, take a token."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, token: int) -> bool: ...


class Engine:
    name: str
    dependencies: str

    def compile(self, schema: str) -> object: ...  # what the engine caches per schema
    def matcher(self, compiled: object) -> Matcher: ...


# --- the three engines ------------------------------------------------------------------------------
class LLGuidance(Engine):
    name, dependencies = "llguidance", "none"

    def __init__(self, vocab: Vocab) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.fill_mask = llguidance, llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, eos_token=vocab.eos)

    def compile(self, schema: str):
        matcher = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_json_schema(schema))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled) -> Matcher:
        inner, fill = compiled.deep_copy(), self.fill_mask
        return _Wrapped(lambda bitmask, row: fill(inner, bitmask, row), inner.consume_token)


class XGrammar(Engine):
    name, dependencies = "xgrammar", "torch, transformers, triton, apache-tvm-ffi, pydantic, numpy"

    def __init__(self, vocab: Vocab, cache: bool = True) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(vocab.byte_level, xgrammar.VocabType.BYTE_LEVEL, stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=cache)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema)

    def matcher(self, compiled) -> Matcher:
        inner = self.xgr.GrammarMatcher(compiled)
        return _Wrapped(inner.fill_next_token_bitmask, inner.accept_token)


class OutlinesCore(Engine):
    name, dependencies = "outlines-core", "none"

    def __init__(self, vocab: Vocab) -> None:
        import outlines_core

        self.oc = outlines_core
        tokens: dict[bytes, list[int]] = {}
        for index, token in enumerate(vocab.token_bytes()):
            if index != vocab.eos:
                tokens.setdefault(token, []).append(index)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos, tokens)

    def compile(self, schema: str):
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled) -> Matcher:
        guide = self.oc.Guide(compiled)

        def fill(bitmask: torch.Tensor, row: int) -> None:
            target = bitmask[row]
            guide.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

        return _Wrapped(fill, lambda token: bool(guide.advance(token)) or True)


class _Wrapped(Matcher):
    def __init__(self, fill: Callable[[torch.Tensor, int], None], accept: Callable[[int], bool]) -> None:
        self.fill, self.accept = fill, accept


def build(name: str, vocab: Vocab) -> Engine:
    return {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}[name](vocab)


# --- measurements -------------------------------------------------------------------------------------
def bitmask_for(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def compile_times(engine: Engine, vocab: Vocab, fresh: Callable[[], Engine]) -> tuple[list[float], list[float]]:
    """ms from schema text to a first mask: cold (a fresh engine, nothing cached) and cached."""
    cold, cached = [], []
    bitmask = bitmask_for(1, len(vocab.byte_level))
    for _, schema, _ in SCHEMAS:
        text = json.dumps(schema)
        cold_engine = fresh()
        start = time.process_time()
        cold_engine.matcher(cold_engine.compile(text)).fill(bitmask, 0)
        cold.append((time.process_time() - start) * 1e3)
        compiled = engine.compile(text)  # the engine's cache (or our own: the compiled object) now holds it
        start = time.process_time()
        engine.matcher(compiled if engine.name != "xgrammar" else engine.compile(text)).fill(bitmask, 0)
        cached.append((time.process_time() - start) * 1e3)
    return cold, cached


def mask_cost(engine: Engine, vocab: Vocab, rows: int, steps: int) -> tuple[float, bool]:
    """CPU µs per row per step of filling masks and consuming tokens; and whether all accepted."""
    compiled = [engine.compile(json.dumps(schema)) for _, schema, _ in SCHEMAS]
    instances = [vocab.tokenizer.encode(json.dumps(instance)) for _, _, instance in SCHEMAS]
    row_schema = [r % len(SCHEMAS) for r in range(rows)]
    matchers = [engine.matcher(compiled[s]) for s in row_schema]
    position = [0] * rows
    bitmask = bitmask_for(rows, len(vocab.byte_level))
    accepted, spent, done = True, 0.0, 0
    for _ in range(steps):
        start = time.process_time()
        for row, matcher in enumerate(matchers):
            matcher.fill(bitmask, row)
        for row, matcher in enumerate(matchers):
            tokens = instances[row_schema[row]]
            token = tokens[position[row]]
            allowed = bool((bitmask[row, token // 32] >> (token % 32)) & 1)
            accepted &= allowed and matcher.accept(token) is not False
            position[row] += 1
            if position[row] == len(tokens):  # the instance is done: this row starts another
                matchers[row], position[row] = engine.matcher(compiled[row_schema[row]]), 0
        spent += time.process_time() - start
        done += rows
    return spent / done * 1e6, accepted


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"), help="for its tokenizer")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=60)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.steps = [1, 2], 3
    torch.set_num_threads(1)
    vocab = Vocab.load(args.model_dir)
    print(describe_machine())
    print(f"{len(SCHEMAS)} schemas: {', '.join(name for name, _, _ in SCHEMAS)}; vocabulary {len(vocab.byte_level)}")
    rows_header = "".join(f"{f'mask µs/row @{r}':>17s}" for r in args.rows)
    print(f"{'engine':14s} {'compile ms cold (median, max)':>30s} {'cached ms (median)':>19s}{rows_header}  all accepted  extra dependencies")
    for name in args.engines:
        try:
            engine = build(name, vocab)
        except ImportError as exc:
            print(f"{name:14s} not installed ({exc})")
            continue
        fresh = (lambda: XGrammar(vocab, cache=False)) if name == "xgrammar" else (lambda: build(name, vocab))
        cold, cached = compile_times(engine, vocab, fresh)
        costs = [mask_cost(engine, vocab, rows, args.steps) for rows in args.rows]
        masks = "".join(f"{cost:17.1f}" for cost, _ in costs)
        accepted = all(ok for _, ok in costs)
        print(f"{name:14s} {statistics.median(cold):20.1f}, {max(cold):7.1f} {statistics.median(cached):19.2f}{masks}"
              f"  {'yes' if accepted else 'NO':>12s}  {engine.dependencies}", flush=True)


if __name__ == "__main__":
    main()
