"""Constrained decoding: each constrained sequence's allowed tokens, step by step, from llguidance.

llguidance was chosen by measurement (bench/grammar_engines.py, docs/structured-output.md): on
GPT-2's vocabulary it compiles a 10-20 property JSON schema in ~2 ms where xgrammar and
outlines-core take 1.3-4 s, its per-row mask costs tens of µs, and it needs no other package.

A request's grammar arrives as llguidance's own grammar text (built and validated by the HTTP
side from a JSON schema, a regex, a choice or a Lark grammar). The core compiles it once per
content (an LRU of compiled matchers; each sequence gets a copy), fills the step's bitmask for
the constrained rows only, and turns it into a boolean mask over the vocabulary on the logits'
device. The sampler then sees -inf wherever the grammar forbids a token: greedy, seeded
sampling, top-k/top-p and log-probabilities all act on the constrained distribution.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from model.transfer import to_device
from weights.tokenizer import GPT2Tokenizer

# Compiled grammars kept (per engine core, and per HTTP process to check requests): a request
# repeating a schema skips its compilation.
CACHE_SIZE = 64


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Grammars:
    """The core's grammar engine: compile (cached by content), start a matcher, mask a step."""

    @classmethod
    def for_tokenizer(cls, tokenizer: GPT2Tokenizer, vocab_size: int) -> "Grammars":
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's)."""
        return cls(tokenizer.to_json, vocab_size, tokenizer.eos_token_id)

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_id: int) -> None:
        """`tokenizer_json` is called once, when the first grammar is compiled: llguidance's
        tokenizer takes ~0.2 s to build, which an engine that never sees a grammar never pays."""
        self.vocab_size = vocab_size
        self._tokenizer_json, self._eos = tokenizer_json, eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # Compiled off the caller's thread (`prepare`); results taken by `ready`, on the caller's.
        self._pool: ThreadPoolExecutor | None = None
        self._compiling: dict[str, Future] = {}
        # Grammars that failed there, and why, until the core refuses their requests.
        self.errors: dict[str, str] = {}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (llguidance's grammar text)."""
        return self.compile(grammar).deep_copy()

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar, from the cache or now. Raises ValueError if it does not compile
        (the HTTP side checks each grammar with this before the core sees it)."""
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        return self._keep(grammar, llguidance.LLMatcher(self.tokenizer, grammar))

    def prepare(self, grammar: str) -> None:
        """Start compiling `grammar` on a worker thread, unless it is cached or under way. The
        engine core's step loop goes on meanwhile (llguidance releases the GIL while it compiles,
        ~2 ms for a typical schema, 0.2 s more for the first grammar: the tokenizer); `collect`
        takes its result, `ready` says whether it has."""
        if grammar in self._compiled or grammar in self._compiling:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiling[grammar] = self._pool.submit(lambda: llguidance.LLMatcher(self.tokenizer, grammar))

    def collect(self) -> None:
        """Take the results of the compilations finished since the last call: each is cached, or
        its error kept in `errors`. Called once per engine step, so every request of one grammar
        becomes ready in the same step, whenever the worker finished (admission stays a function
        of the steps, not of the worker's timing)."""
        for grammar in [g for g, future in self._compiling.items() if future.done()]:
            future = self._compiling.pop(grammar)
            try:
                self._keep(grammar, future.result())
            except ValueError as exc:
                self.errors[grammar] = str(exc)

    def ready(self, grammar: str) -> bool:
        """False while `grammar` compiles on the worker thread (until a `collect` after it is done)."""
        return grammar not in self._compiling

    def _keep(self, grammar: str, compiled: llguidance.LLMatcher) -> llguidance.LLMatcher:
        if compiled.is_error():
            raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
        self._compiled[grammar] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def cached(self, grammar: str) -> bool:
        return grammar in self._compiled

    def banned(
        self, matchers: list[llguidance.LLMatcher | None], device: torch.device, ahead: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """[B, V] bool on `device`: True where row b's grammar forbids the token (no row of a
        None matcher forbids anything), and the rows whose matcher failed (llguidance's error, by
        row): those forbid nothing, so the step samples them safely, and their requests fail.
        `ahead[b]`: tokens row b's matcher takes before its mask (a draft's row j, verified in the
        same step, sees the draft's first j tokens), rolled back after it."""
        rows = len(matchers)
        bitmask = torch.full((rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        row_bytes = bitmask.stride(0) * bitmask.element_size()
        errors: dict[int, str] = {}
        for row, matcher in enumerate(matchers):
            if matcher is None:
                continue
            tokens = ahead[row] if ahead is not None else []
            try:
                if tokens:
                    matcher.consume_tokens(tokens)
                # llguidance writes the row's words in place (the bitmask is ours, contiguous).
                matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
                if tokens:
                    matcher.rollback(len(tokens))
            except Exception as exc:  # llguidance raises only on misuse; still this row's alone
                errors[row] = f"{type(exc).__name__}: {exc}"
            if row not in errors and matcher.is_error():
                errors[row] = matcher.get_error()
            if row in errors:
                bitmask[row] = -1
        bits = torch.arange(32, dtype=torch.int32, device=device)
        words = to_device(bitmask, device, torch.int32)  # pinned: queued, the host goes on
        allowed = ((words[:, :, None] >> bits) & 1).reshape(rows, -1)[:, : self.vocab_size]  # [B, V]
        return allowed == 0, errors
