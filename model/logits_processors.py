"""Decoding controls beyond temperature/top-k/top-p/repetition penalty, vectorised over rows.

Each is a pure function over [B, V] scores with per-row parameters (tensors, one entry per
row), so a batch mixing rows that use a control with rows that do not needs no per-row Python
work. The definitions are transformers' logits processors where transformers has the control
(min_p, typical_p, min_new_tokens, no_repeat_ngram_size, bad_words_ids, sequence_bias as
logit_bias) and vLLM's where only vLLM has it (presence and frequency penalties, OpenAI's).
A row's neutral value leaves its scores unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.vocab_sort import sort_ascending

NO_TOKEN = -1  # padding in token tables: matches no token


@dataclass
class Controls:
    """The gathered controls of one step's rows; None for a stage no row uses."""

    bias: torch.Tensor | None  # [B, V]
    counts: torch.Tensor | None  # [B, V] int32 tokens generated so far
    floats: torch.Tensor  # [B, 4] presence, frequency, min_p, typical_p
    new_tokens: torch.Tensor | None  # [B] tokens generated so far
    min_new_tokens: torch.Tensor | None  # [B]
    stop_tokens: torch.Tensor | None  # [B, V] bool: EOS (unless ignore_eos) and stop_token_ids
    history: torch.Tensor | None  # [B, L] prompt + output tokens
    lengths: torch.Tensor | None  # [B] tokens in history
    ngram: torch.Tensor | None  # [B] no_repeat_ngram_size (0: off)
    max_ngram: int
    bad: torch.Tensor | None  # [B, S, W] bad word sequences, right-aligned
    warpers: bool


def apply_controls(scores: torch.Tensor, c: Controls) -> torch.Tensor:
    """The processors that act on every row, greedy or sampled, after the repetition penalty
    (transformers' order: penalty, n-grams, bad words, min length; vLLM's penalties beside)."""
    if c.counts is not None:
        scores = apply_presence_frequency(scores, c.counts, c.floats[:, 0], c.floats[:, 1])
    vocab = scores.shape[-1]
    if c.history is not None:
        if c.max_ngram > 0:
            scores = suppress(scores, ngram_bans(c.history, c.lengths, c.ngram, vocab, c.max_ngram))
        if c.bad is not None:
            scores = suppress(scores, bad_words_bans(c.history, c.lengths, c.bad, vocab))
    if c.stop_tokens is not None:
        scores = suppress(scores, min_new_tokens_bans(c.stop_tokens, c.new_tokens, c.min_new_tokens))
    return scores


def apply_warpers(scores: torch.Tensor, c: Controls) -> torch.Tensor:
    """min_p then typical_p, after temperature, top-k and top-p (transformers' order)."""
    if c.warpers:
        scores = apply_typical_p(apply_min_p(scores, c.floats[:, 2]), c.floats[:, 3])
    return scores


def apply_presence_frequency(
    scores: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties on the tokens generated so far (the prompt not counted):
    subtract frequency × count, and presence once for any token that occurred.

    counts [B, V] how often each token was generated; presence, frequency [B].
    """
    counts = counts.to(scores.dtype)
    return scores - frequency[:, None] * counts - presence[:, None] * (counts > 0)  # [B, V]


def suppress(scores: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """-inf where banned [B, V] is True."""
    return scores.masked_fill(banned, float("-inf"))


def min_new_tokens_bans(stop_tokens: torch.Tensor, new_tokens: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """transformers' MinNewTokensLengthLogitsProcessor: a row that has generated fewer than its
    minimum may not end, so its stop tokens (EOS, stop_token_ids) are banned. [B, V] bool."""
    return stop_tokens & (new_tokens < minimum)[:, None]


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' MinPLogitsWarper: drop tokens less likely than min_p × the top token's
    probability; the top token always stays. min_p [B], 0 keeps everything."""
    probs = scores.softmax(dim=-1)  # [B, V]
    top = probs.amax(dim=-1, keepdim=True)  # [B, 1]
    remove = probs < min_p[:, None] * top
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return suppress(scores, remove)


def apply_typical_p(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """transformers' TypicalLogitsWarper (locally typical sampling, Meister et al. 2022): keep the
    tokens whose surprise is closest to the entropy until their probability reaches `mass`.
    mass [B]; rows with mass >= 1 are left as they are (transformers skips the warper there)."""
    normalized = scores.log_softmax(dim=-1)  # [B, V]
    p = normalized.exp()
    entropy = -row_nansum(normalized * p)  # [B, 1]
    shifted = (-normalized - entropy).abs()  # [B, V]
    # Stable: distances tie often (float32 surprises near the entropy sit on a grid of ~1e-6),
    # and tied tokens of different probability reach the mass in the order they are counted:
    # lowest id first, not whatever order the kernel leaves them in (transformers' unstable sort).
    sorted_shifted, sorted_index = sort_ascending(shifted)  # [B, V] ascending
    cumulative = scores.gather(-1, sorted_index).softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    last = (cumulative < mass[:, None]).sum(dim=1).clamp(max=scores.shape[-1] - 1)  # [B]
    remove_sorted = sorted_shifted > sorted_shifted.gather(1, last[:, None])  # [B, V]
    remove_sorted[:, :1] = False  # min_tokens_to_keep = 1
    remove = remove_sorted.scatter(1, sorted_index, remove_sorted)  # [B, V] original order
    remove &= (mass < 1.0)[:, None]
    return suppress(scores, remove)


def row_nansum(x: torch.Tensor) -> torch.Tensor:
    """Each row's nansum [B, 1], with the same bits alone and in a batch: PyTorch splits the sum
    of a lone row across CPU threads (the summation order then follows the thread count), while
    rows of a batch are each summed whole. So a lone row is summed as one of two."""
    if x.shape[0] == 1:
        return x.repeat(2, 1).nansum(dim=-1, keepdim=True)[:1]
    return x.nansum(dim=-1, keepdim=True)


def ngram_bans(history: torch.Tensor, lengths: torch.Tensor, n: torch.Tensor, vocab: int, max_n: int) -> torch.Tensor:
    """transformers' NoRepeatNGramLogitsProcessor: ban every token that would complete an n-gram
    already in the row's tokens (prompt and output). [B, V] bool.

    history [B, L] each row's tokens (valid up to lengths [B]); n [B] (0: off); max_n the largest
    n in the batch (a Python int, so the loop below runs over n-gram positions, not rows).
    Token p of a row is banned-next when the n-1 tokens before p equal the row's last n-1 tokens.
    """
    length = history.shape[1]
    positions = torch.arange(length, device=history.device)[None, :]  # [1, L]
    # p ranges over positions holding the token that followed an earlier (n-1)-gram.
    match = (positions >= (n - 1)[:, None]) & (positions < lengths[:, None]) & (n[:, None] > 0)  # [B, L]
    match &= (lengths >= n)[:, None]
    for k in range(1, max_n):
        # Compare the token k before p with the row's k-th last token, where k < n.
        before = torch.roll(history, shifts=k, dims=1)  # [B, L]: before[:, p] = history[:, p - k]
        last = history.gather(1, (lengths - k).clamp(min=0)[:, None])  # [B, 1]
        match &= (before == last) | (k >= n)[:, None]
    return any_at(history, match, vocab)


def any_at(tokens: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: True at tokens[b, i] for every i where mask[b, i] (a scatter-or)."""
    hits = torch.zeros(tokens.shape[0], vocab, dtype=torch.int32, device=tokens.device)
    return hits.scatter_add_(1, tokens.clamp(min=0), mask.to(torch.int32)) > 0


def bad_words_bans(history: torch.Tensor, lengths: torch.Tensor, bad: torch.Tensor, vocab: int) -> torch.Tensor:
    """transformers' NoBadWordsLogitsProcessor: ban a bad sequence's last token when the row's
    last tokens equal the rest of it (a one-token sequence is always banned). [B, V] bool.

    bad [B, S, W]: each row's bad sequences, right-aligned and left-padded with NO_TOKEN (a
    sequence of all NO_TOKEN is no sequence).
    """
    width = bad.shape[-1]
    # The row's last W-1 tokens, NO_TOKEN - 1 before its start (matches nothing): [B, W-1]
    offsets = torch.arange(width - 1, 0, -1, device=history.device)  # [W-1]: W-1 ... 1
    index = lengths[:, None] - offsets[None, :]  # [B, W-1]
    tail = history.gather(1, index.clamp(min=0)).masked_fill(index < 0, NO_TOKEN - 1)
    prefix, final = bad[..., :-1], bad[..., -1]  # [B, S, W-1], [B, S]
    match = ((prefix == NO_TOKEN) | (prefix == tail[:, None, :])).all(dim=-1) & (final != NO_TOKEN)  # [B, S]
    return any_at(final, match, vocab)
