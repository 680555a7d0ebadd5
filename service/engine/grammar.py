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

A grammar is compiled together with its first mask (`Grammars.compile`, on the HTTP side's check
and on the core's worker thread): llguidance builds a grammar's lexer and parser lazily, so a
hostile one compiles in milliseconds and fails, or runs for seconds, only when a mask is first
computed. That mask, and the one after each token it allows where it allows few, are computed
there, off the step loop; a grammar that errors in them, or allows no token but EOS, is refused
as a compile error. llguidance's own limits (`LIMITS`) bound every later mask's work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from weakref import WeakKeyDictionary

import llguidance
import numpy as np
import torch

from model.transfer import to_device
from weights.tokenizer import GPT2Tokenizer

# Compiled grammars kept (per engine core, and per HTTP process to check requests): a request
# repeating a schema skips its compilation.
CACHE_SIZE = 64
# llguidance's parser limits, set for a time budget per mask on GPT-2's vocabulary (measured in
# docs/structured-output.md: at most ~30 ms of CPU for the worst grammars tried, where llguidance's
# defaults let one mask run for 0.2 s to several seconds). A grammar that reaches one fails alone.
LIMITS = {
    # Earley items in one row: an ambiguous grammar's rows grow with its text, and a mask's work
    # with their square (under the default 2,000, 0.15-0.5 s per mask by 600 tokens, and
    # growing; 500 keeps it to ~20 ms). A JSON object's optional properties take 4 items each:
    # at most 123 in one object (service/http/grammar.py refuses more before compiling).
    "max_items_in_row": 500,
    # Lexer work per mask (the default 200,000 let a repeated regex spend 0.17 s); a regex
    # alternation of 3,000 words still runs.
    "step_lexer_fuel": 50_000,
    # Lexer work when the grammar is built, which its first mask shares (the default 1,000,000
    # let `(a{1000}){1000}` take 1-3 s there; ~0.1 s now, off the step loop). Every schema and
    # regex of the tests and benches, 10,000-character strings and 3,000-word enums, fit.
    "initial_lexer_fuel": 100_000,
    # Lexer states a matcher may build (1-2 kB each): 100 MB at most, not llguidance's 500.
    "max_lexer_states": 50_000,
    # Errors without the parser's state dump (a client's 422 carries the first line).
    "verbose_errors": False,
}
# Where a grammar's first mask allows at most this many tokens (a forced start: `{`, `[[`,
# `aaaa`), the mask after each of them is computed with the compile too: the hostile grammars
# found fail there, on their second mask, rather than on the step loop.
PROBED_TOKENS = 8


# llguidance's tokenizers built in this process, by our tokenizer (held weakly), then vocabulary
# size and EOS: built once, shared by every Grammars of that tokenizer (read-only once built).
_LL_TOKENIZERS: WeakKeyDictionary[object, dict[tuple[int, int], llguidance.LLTokenizer]] = WeakKeyDictionary()
_BUILDING = Lock()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Grammars:
    """The core's grammar engine: compile (cached by content), start a matcher, mask a step."""

    @classmethod
    def for_tokenizer(cls, tokenizer: GPT2Tokenizer, vocab_size: int) -> "Grammars":
        """`vocab_size`: the model's (its logits' width, which may exceed the tokenizer's).
        llguidance's tokenizer is built now, on the compile thread, once per process and
        tokenizer: it holds the GIL for the 0.3-0.6 s it takes, which at the first grammar would
        stall the step loop (or the HTTP side's event loop) and every stream with it."""
        grammars = cls(tokenizer.to_json, vocab_size, tokenizer.eos_token_id, source=tokenizer)
        grammars._compile_pool().submit(lambda: grammars.tokenizer)
        return grammars

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_id: int, source: object = None) -> None:
        """`tokenizer_json` is called once, when llguidance's tokenizer is first needed; `source`
        (our tokenizer) keys the process's built ones, so that engines of one tokenizer share it."""
        self.vocab_size = vocab_size
        self._tokenizer_json, self._eos, self._source = tokenizer_json, eos_token_id, source
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._limits = llguidance.LLParserLimits(**LIMITS)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # Compiled off the caller's thread (`prepare`); results taken by `ready`, on the caller's.
        self._pool: ThreadPoolExecutor | None = None
        self._compiling: dict[str, Future] = {}
        # Grammars that failed there, and why, until the core refuses their requests.
        self.errors: dict[str, str] = {}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            with _BUILDING:
                shared = _LL_TOKENIZERS.setdefault(self._source, {}) if self._source is not None else {}
                key = (self.vocab_size, self._eos)
                if key not in shared:
                    shared[key] = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos)
                self._tokenizer = shared[key]
        return self._tokenizer

    def _compile_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._pool

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (llguidance's grammar text)."""
        return self.compile(grammar).deep_copy()

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar, from the cache or now. Raises ValueError if it does not compile
        or fails its first masks (the HTTP side checks each grammar with this before the core
        sees it)."""
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        return self._keep(grammar, self._build(grammar))

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher for `grammar` with its first mask computed (and, where that allows few
        tokens, the mask after each of them, rolled back), or ValueError saying why it cannot
        run. Touches no shared state but the tokenizer: safe on a worker thread."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=self._limits, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {first_line(matcher.get_error())}")
        scratch = np.empty(bitmask_words(self.vocab_size), dtype=np.int32)
        self._mask(matcher, scratch, "at its start")
        tokens = self._unpack(scratch)
        tokens = tokens[tokens != self._eos]
        if tokens.size == 0:
            raise ValueError("the grammar matches only the empty text: there is nothing to generate"
                             if matcher.is_accepting() else "the grammar matches no text: nothing may come at its start")
        if tokens.size <= PROBED_TOKENS:
            for token in tokens.tolist():
                matcher.consume_token(token)  # holds the GIL, for at most what LIMITS allow a step
                self._mask(matcher, scratch, f"after its first token {self.tokenizer.decode_str([token])!r}")
                matcher.rollback(1)
        return matcher

    def _mask(self, matcher: llguidance.LLMatcher, scratch: np.ndarray, where: str) -> None:
        """`matcher`'s mask into `scratch`; ValueError naming llguidance's reason if it fails (a
        limit reached, or a grammar that cannot go on)."""
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():
            error = first_line(matcher.get_error())
            if error.startswith("NoExtension"):  # llguidance: no byte may follow, and the text is not complete
                raise ValueError(f"the grammar matches no text: nothing may come {where}")
            raise ValueError(f"the grammar fails {where}: {error}")

    def _unpack(self, bitmask: np.ndarray) -> np.ndarray:
        """The token ids a one-row bitmask allows."""
        return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: self.vocab_size])

    def prepare(self, grammar: str) -> None:
        """Start compiling `grammar` on a worker thread, unless it is cached or under way. The
        engine core's step loop goes on meanwhile (llguidance releases the GIL while it compiles,
        ~2 ms for a typical schema, 0.2 s more for the first grammar: the tokenizer); `collect`
        takes its result, `ready` says whether it has."""
        if grammar in self._compiled or grammar in self._compiling:
            return
        self._compiling[grammar] = self._compile_pool().submit(self._build, grammar)

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
            except Exception as exc:  # llguidance raising otherwise: still this grammar's requests' alone
                self.errors[grammar] = f"the grammar could not be compiled: {type(exc).__name__}: {exc}"

    def ready(self, grammar: str) -> bool:
        """False while `grammar` compiles on the worker thread (until a `collect` after it is done)."""
        return grammar not in self._compiling

    def _keep(self, grammar: str, compiled: llguidance.LLMatcher) -> llguidance.LLMatcher:
        self._compiled[grammar] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def cached(self, grammar: str) -> bool:
        return grammar in self._compiled

    def banned(
        self, matchers: list[llguidance.LLMatcher | None], device: torch.device, ahead: list[list[int]] | None = None
    ) -> tuple[list[int], torch.Tensor, dict[int, str]]:
        """The rows with a matcher (the others forbid nothing), [k, V] bool on `device` for them:
        True where its grammar forbids the token, and the rows whose matcher failed (llguidance's
        error, by row): those forbid nothing, so the step samples them safely, and their requests
        fail. `ahead[b]`: tokens row b's matcher takes before its mask (a draft's row j, verified
        in the same step, sees the draft's first j tokens), rolled back after it."""
        constrained = [row for row, matcher in enumerate(matchers) if matcher is not None]
        words = bitmask_words(self.vocab_size)
        # A numpy bitmask: each row's address is arithmetic (no tensor made per row).
        bitmask = np.full((len(constrained), words), -1, dtype=np.int32)
        address, row_bytes = bitmask.ctypes.data, bitmask.strides[0]
        errors: dict[int, str] = {}
        for at, row in enumerate(constrained):
            matcher = matchers[row]
            tokens = ahead[row] if ahead is not None else None
            try:
                if tokens:
                    matcher.consume_tokens(tokens)
                # llguidance writes the row's words in place (the bitmask is ours, contiguous).
                matcher.unsafe_compute_mask_ptr(address + at * row_bytes, row_bytes)
                if tokens:
                    matcher.rollback(len(tokens))
                if matcher.is_error():
                    errors[row] = first_line(matcher.get_error())
            except Exception as exc:  # llguidance raises only on misuse; still this row's alone
                errors[row] = f"{type(exc).__name__}: {exc}"
            if row in errors:
                bitmask[at] = -1
        if device.type == "cpu":  # numpy unpacks the bits in one call
            allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]  # [k, V]
            return constrained, torch.from_numpy(allowed == 0), errors
        # Elsewhere the packed words cross (32x fewer bytes) and are unpacked on the device.
        bits = torch.arange(32, dtype=torch.int32, device=device)
        packed = to_device(bitmask, device, torch.int32)  # pinned: queued, the host goes on
        # 32 bits a word, spelled out: -1 cannot be inferred for k = 0 rows (a constrained
        # sequence that ended while its draw waited for the step before: StepSampler.launch).
        allowed = ((packed[:, :, None] >> bits) & 1).reshape(len(constrained), words * 32)[:, : self.vocab_size]  # [k, V]
        return constrained, allowed == 0, errors


def first_line(error: str) -> str:
    """llguidance's error without what follows its first line (a state dump, or a marker that
    there is none)."""
    return error.split("\n", 1)[0]
