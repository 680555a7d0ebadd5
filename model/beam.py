"""Beam search bookkeeping with the semantics of transformers' `generate(num_beams=...)`.

This mirrors `GenerationMixin._beam_search` (transformers 5.x) for one prompt, so a request
served here returns the same sequences and `sequences_scores` as `generate()`:

* scores: log_softmax of the raw logits (in float32), then the logits processors (here only
  repetition_penalty, which sees the prompt plus the beam's own tokens and, on log-probs that
  are all <= 0, multiplies each seen token's log-prob by the penalty once), then the beam's
  running score is added. Beam 0 starts at 0 and the others at -1e9, so the first step expands
  one beam only.
* each step keeps the top 2 * num_beams candidates over all beams; a candidate that ends in
  eos_token_id or reaches max_new_tokens is finished. Only finished candidates ranked within
  the first num_beams enter the finished set, scored sum_logprobs / generated_len **
  length_penalty, where generated_len counts every generated token including the EOS. The best
  num_beams unfinished candidates run on.
* generation stops when the best running beam can no longer beat the worst of num_beams finished
  hypotheses (its score divided by the current generated length ** length_penalty; with
  early_stopping="never" and length_penalty > 0, by max_new_tokens ** length_penalty), or, with
  early_stopping=True, as soon as num_beams hypotheses are finished, or when every candidate
  hit max_new_tokens.
* the result is the finished set sorted best first, cut to num_return_sequences. Sequences keep
  their EOS token, as in generate() (which also pads shorter ones; we do not).

generate() with num_beams=1 is greedy decoding, not this, so BeamParams requires num_beams >= 2.

Use from an engine (one KV-cache slot per beam):

    search = BeamSearch(BeamParams(num_beams=4, eos_token_id=50256, max_new_tokens=32), prompt)
    logits = prefill(prompt)                      # [1, V]: only beam 0 is live at first
    while True:
        step = search.step(logits)                # logits [num_beams, V] (or [1, V] at first)
        if step.done:
            break
        reorder_beam_slots(cache, slots, step.source_beams, length=position)
        logits = decode(step.next_tokens, slots)  # row i feeds step.next_tokens[i]
    hypotheses = search.finish()                  # best first, num_return_sequences of them

`beam_generate` is that loop for a model and a KV cache, ready to use or to copy. `step` is two
halves an engine batching many searches calls apart: `beam_candidates` (the vocabulary-wide work,
for every search of a step at once, on the logits' device) and `BeamSearch.advance` (the
bookkeeping on the host, from the few numbers that returns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache
from model.sampling import apply_repetition_penalty
from model.scoring import top_nonpositive
from model.transfer import to_device

# transformers marks impossible beams with this score rather than -inf, so arithmetic on them
# stays finite; using the same constant keeps rankings identical in the corner cases.
NEG_SCORE = -1.0e9
NEG_SCORE32 = np.float32(NEG_SCORE)  # exact

BeamFinishReason = Literal["eos_token", "length"]


@dataclass(frozen=True)
class BeamParams:
    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: int = 1
    eos_token_id: int | None = None  # None: only max_new_tokens ends a hypothesis
    max_new_tokens: int = 20
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.num_beams < 2:
            raise ValueError(
                f"num_beams must be at least 2 for beam search, got {self.num_beams}"
                " (num_beams=1 is greedy decoding)"
            )
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(
                f"num_return_sequences must be in [1, num_beams={self.num_beams}],"
                f" got {self.num_return_sequences}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be a positive number, got {self.repetition_penalty}"
            )


@dataclass
class BeamStep:
    next_tokens: list[int]  # the token row i of the next decode step feeds
    source_beams: list[int]  # row i continues the beam that was in row source_beams[i]
    done: bool  # stop decoding and call finish(); next_tokens/source_beams are then unused


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens only, ending with the EOS when it finished on one
    token_logprobs: list[float]  # each token's processed log-prob (after repetition_penalty)
    score: float  # sum(token_logprobs) / len(token_ids) ** length_penalty
    finish_reason: BeamFinishReason


class BeamSearch:
    """The state of one beam-search request; feed it each step's logits, read what to run next."""

    def __init__(self, params: BeamParams, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("beam search needs a prompt of at least one token")
        self.params = params
        self.prompt_ids = list(prompt_ids)
        n = params.num_beams
        # A candidate list this long always holds num_beams that did not just end on the EOS.
        self._candidates = max(2, 1 + (params.eos_token_id is not None)) * n
        self._generated = 0  # tokens generated so far by every running beam
        self.done = False
        # Bookkeeping over 2 * num_beams candidates is tiny: it runs on the host, in Python over
        # float32 values (Python floats holding them exactly, their arithmetic in numpy's float32
        # scalars, which is torch's: a float32 divided by a Python float is divided by that float
        # rounded to float32 in both); only vocab-sized work stays on the logits' device.
        self._running_scores = [0.0] + [NEG_SCORE] * (n - 1)  # [num_beams]
        # Each running beam's generated tokens and their log-probs, newest first, as links
        # (token, log-prob, the links before): a step adds one link a beam, however long the
        # beams are, and beams continuing one beam share its links. Read out when one finishes.
        self._running_paths: list[tuple | None] = [None] * n
        self._finished_scores = [NEG_SCORE] * n  # [num_beams], best first
        self._finished_flags = [False] * n  # [num_beams]
        self._finished: list[Hypothesis | None] = [None] * n
        self._improvement_possible = True
        self._seen: torch.Tensor | None = None  # [num_beams, V] bool, for repetition_penalty

    def step(self, logits: torch.Tensor) -> BeamStep:
        """Advance every beam by one token given the raw logits of the running beams."""
        if self.done:
            raise RuntimeError("beam search is done; call finish()")
        params = self.params
        n = params.num_beams
        expected_rows = (1, n) if self._generated == 0 else (n,)
        if logits.dim() != 2 or logits.shape[0] not in expected_rows:
            raise ValueError(
                f"expected logits [num_beams={n}, vocab], got {list(logits.shape)}"
                + (" (or [1, vocab] for the first step)" if self._generated == 0 else "")
            )
        running = torch.tensor([self._running_scores], dtype=torch.float32)  # [1, n]
        candidates = beam_candidates(logits.expand(n, logits.shape[-1])[None], running, [self])  # [1, 3K]
        # One device-to-host transfer per step.
        return self.advance(*split_candidates(candidates[0].tolist(), self.candidates), logits.shape[-1])

    def advance(self, top_totals: list[float], top_logprobs: list[float], flat: list[int], vocab: int) -> BeamStep:
        """Advance every beam by one token given this step's best candidates (`beam_candidates`,
        computed wherever the logits are): their total scores (float32 values), their tokens' own
        log-probs and their flat indices (beam * vocab + token), best first. Host work only."""
        if self.done:
            raise RuntimeError("beam search is done; call finish()")
        params = self.params
        n = params.num_beams
        beams = [index // vocab for index in flat]
        tokens = [index % vocab for index in flat]
        generated = self._generated + 1
        at_limit = generated >= params.max_new_tokens
        hits = [at_limit or tok == params.eos_token_id for tok in tokens]  # [K]: it ends its hypothesis

        # Running beams for the next step: the best num_beams candidates that did not finish.
        running_totals = [float(np.float32(total) + NEG_SCORE32) if hit else total
                          for total, hit in zip(top_totals, hits)]  # [K]
        keep = best_first(running_totals, n)
        source_beams = [beams[k] for k in keep]
        next_tokens = [tokens[k] for k in keep]
        self._add_finished(top_totals, hits, beams, tokens, top_logprobs, generated)
        self._running_scores = [running_totals[k] for k in keep]  # [n]
        self._running_paths = [(tokens[k], top_logprobs[k], self._running_paths[beams[k]]) for k in keep]
        self._generated = generated
        self.done = self._should_stop(hits)
        if params.repetition_penalty != 1.0 and not self.done:
            self._advance_seen(source_beams, next_tokens)
        return BeamStep(next_tokens=next_tokens, source_beams=source_beams, done=self.done)

    def finish(self) -> list[Hypothesis]:
        """The best num_return_sequences finished hypotheses, best first."""
        if not self.done:
            raise RuntimeError("beam search is not done yet")
        # The finished set is kept sorted by score (a top-k merge each step).
        found = [hyp for hyp in self._finished if hyp is not None]
        return found[: self.params.num_return_sequences]

    @property
    def candidates(self) -> int:
        """K: the candidates each step keeps (2 * num_beams)."""
        return self._candidates

    @property
    def first_step(self) -> bool:
        """No token generated yet: only beam 0 is live (its logits are the prompt's)."""
        return self._generated == 0

    @property
    def running_scores(self) -> list[float]:
        """[num_beams] float32 values: each running beam's score (NEG_SCORE: not live yet)."""
        return self._running_scores

    def penalise(self, log_probs: torch.Tensor) -> torch.Tensor:
        """log_probs [num_beams, V] after repetition_penalty (unchanged without one)."""
        if self.params.repetition_penalty == 1.0:
            return log_probs
        return self._penalise_repeats(log_probs)

    # --- internals ----------------------------------------------------------------------------
    def _penalise_repeats(self, log_probs: torch.Tensor) -> torch.Tensor:
        n, vocab = log_probs.shape
        if self._seen is None:
            prompt = to_device(self.prompt_ids, log_probs.device)
            self._seen = torch.zeros(n, vocab, dtype=torch.bool, device=log_probs.device)
            self._seen[:, prompt] = True  # [n, V]
        return apply_repetition_penalty(log_probs, self._seen, self.params.repetition_penalty)

    def _advance_seen(self, source_beams: list[int], next_tokens: list[int]) -> None:
        # From pinned memory: an engine calls this while its next step runs on the device.
        device = self._seen.device
        rows = torch.arange(len(source_beams), device=device)
        sources, tokens = to_device([source_beams, next_tokens], device)
        self._seen = self._seen[sources]  # [n, V]
        self._seen[rows, tokens] = True

    def _add_finished(
        self,
        top_totals: list[float],
        hits: list[bool],
        beams: list[int],
        tokens: list[int],
        top_logprobs: list[float],
        generated: int,
    ) -> None:
        n = self.params.num_beams
        divisor = np.float32(generated**self.params.length_penalty)
        # Only the first num_beams candidates may finish; the rest exist so enough keep running
        # (their scores, pushed down by NEG_SCORE, still take the set's empty places).
        just_finished = [hit and k < n for k, hit in enumerate(hits)]  # [K]
        if not any(just_finished) and self._finished_scores[-1] >= NEG_SCORE:
            # The usual step, nothing finished: a pushed-down score (a total is at most 0, so it
            # is at most NEG_SCORE) passes no place of a set whose places are all at least
            # NEG_SCORE (an empty place equal to it comes first), so the set stays as it is.
            return
        scores = [float(np.float32(total) / divisor) if finished else float(np.float32(total) / divisor + NEG_SCORE32)
                  for total, finished in zip(top_totals, just_finished)]  # [K]
        merged_scores = self._finished_scores + scores  # [n + K]
        best = best_first(merged_scores, n)  # [n]: on equal scores, finished earlier first
        merged_flags = self._finished_flags + just_finished
        self._finished = [
            self._finished[i] if i < n else
            self._hypothesis(beams[i - n], tokens[i - n], top_logprobs[i - n], scores[i - n]) if just_finished[i - n]
            else None
            for i in best
        ]
        self._finished_scores = [merged_scores[i] for i in best]
        self._finished_flags = [merged_flags[i] for i in best]

    def _hypothesis(self, beam: int, token: int, logprob: float, score: float) -> Hypothesis:
        """The hypothesis of running beam `beam` ending with `token`."""
        tokens, logprobs, link = [token], [logprob], self._running_paths[beam]
        while link is not None:
            earlier, earlier_logprob, link = link
            tokens.append(earlier)
            logprobs.append(earlier_logprob)
        tokens.reverse()
        logprobs.reverse()
        eos = self.params.eos_token_id
        reason: BeamFinishReason = "eos_token" if eos is not None and tokens[-1] == eos else "length"
        return Hypothesis(token_ids=tokens, token_logprobs=logprobs, score=score, finish_reason=reason)

    def _should_stop(self, hits: list[bool]) -> bool:
        params = self.params
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = params.max_new_tokens  # a longer hypothesis would score higher
        else:
            best_length = self._generated
        best_running = float(np.float32(self._running_scores[0]) / np.float32(best_length**params.length_penalty))
        lowest = min(self._finished_scores)
        # Any place of the finished set still empty keeps the search going.
        self._improvement_possible = self._improvement_possible and any(
            best_running > (lowest if flag else NEG_SCORE) for flag in self._finished_flags
        )
        return (
            not self._improvement_possible
            or (all(self._finished_flags) and params.early_stopping is True)
            or all(hits)
        )


def beam_candidates(logits: torch.Tensor, running: torch.Tensor, searches: list[BeamSearch]) -> torch.Tensor:
    """The best candidates of several beam searches at once, on the logits' device, as
    transformers' `_beam_search` computes them for a batch: log_softmax of each beam's logits (in
    float32), repetition_penalty where a search asks for it, plus the beam's running score, then
    the top K over each search's [beams x V].

    logits [R, N, V]: search r's beams in rows 0..num_beams-1 (N: the widest search; rows past a
    search's own are padding, with a running score of -inf); running [R, N]. Returns [R, 3k]
    float64 (k: the largest K), best first: each candidate's total score, its token's own
    log-prob, its flat index (beam * V + token); search r's own K are the first of each third
    (`split_candidates`). float64 holds the float32 scores and the flat indices exactly.
    """
    parts = candidate_parts(logits, running.to(logits.device, torch.float32), searches)
    out = torch.empty(logits.shape[0], 3 * parts[0].shape[1], dtype=torch.float64, device=logits.device)
    return torch.cat(parts, dim=1, out=out)  # each cast as it is copied


def candidate_parts(
    logits: torch.Tensor, running: torch.Tensor, searches: list[BeamSearch]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`beam_candidates`' three thirds, [R, k] each (running: float32 on the logits' device), for
    a caller that copies them out with more (service/engine/beams.py)."""
    count, width, vocab = logits.shape
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [R, N, V]
    for row, search in enumerate(searches):
        if search.params.repetition_penalty != 1.0:
            beams = search.params.num_beams
            log_probs[row, :beams] = search.penalise(log_probs[row, :beams])
    totals = log_probs + running.unsqueeze(2)  # [R, N, V], every one at most 0 (or -inf)
    k = max(search.candidates for search in searches)
    # Equal totals: the lowest (beam, token) first, whatever device or kernel runs it; so a
    # search's own K are the first K of the widest search's k, padding (-inf) last.
    top_totals, top_flat = top_nonpositive(totals.view(count, width * vocab), k)  # [R, k], [R, k]
    return top_totals, log_probs.view(count, width * vocab).gather(1, top_flat), top_flat


def split_candidates(row: list[float], candidates: int) -> tuple[list[float], list[float], list[int]]:
    """One search's row of `beam_candidates` on the host ([3k] float64 values, as a list: every
    search's rows come over in one `tolist`) → its first `candidates`: total scores, log-probs
    and flat indices, as `advance` takes them."""
    k = len(row) // 3
    return row[:candidates], row[k : k + candidates], [int(index) for index in row[2 * k : 2 * k + candidates]]


def best_first(scores: list[float], n: int) -> list[int]:
    """Indices of the n highest of scores [K], highest first, equal ones in index order (topk
    leaves their order to its algorithm)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:n]


def reorder_beam_slots(cache: KVCache, slots: list[int], source_beams: list[int], length: int) -> None:
    """Make slot i hold the first `length` cached positions of the beam it now continues."""
    moves = [(slots[src], slots[i]) for i, src in enumerate(source_beams) if src != i]
    if moves:
        cache.copy_slots([src for src, _ in moves], [dst for _, dst in moves], length)


def beam_generate(
    model: GPT2, prompt_ids: list[int], params: BeamParams, cache: KVCache | None = None
) -> list[Hypothesis]:
    """Beam-search one prompt with `model`, one slot of `cache` per beam (freed afterwards)."""
    device = model.device
    prompt_length = len(prompt_ids)
    if cache is None:
        cache = KVCache(
            model.config, params.num_beams, prompt_length + params.max_new_tokens, device, model.dtype
        )
    # The last generated token is never fed back, so it needs no cache position.
    needed = prompt_length + params.max_new_tokens - 1
    if needed > cache.max_len:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({params.max_new_tokens}) needs"
            f" {needed} cached positions; the cache's max_len is {cache.max_len}"
        )
    search = BeamSearch(params, prompt_ids)
    slots = cache.allocate(params.num_beams)
    try:
        # Every beam starts from the same prompt: prefill it once, into beam 0's slot; the first
        # reorder copies it to the beams that continue from it.
        prompt = torch.tensor([prompt_ids], device=device)  # [1, T]
        last = torch.tensor([prompt_length - 1], device=device)  # [1]
        logits = model(prompt, cache=cache, rows=cache.batch(slots[:1]), logits_index=last).logits
        position = prompt_length
        while not (step := search.step(logits)).done:
            reorder_beam_slots(cache, slots, step.source_beams, position)
            tokens = torch.tensor(step.next_tokens, device=device)[:, None]  # [n, 1]
            positions = torch.full_like(tokens, position)  # [n, 1]
            out = model(tokens, positions, cache, cache.batch(slots), kv_length=position + 1)
            logits = out.logits[:, -1]  # [n, V]
            position += 1
        return search.finish()
    finally:
        cache.free(slots)
