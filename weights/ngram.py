"""Count-based baselines for the trained model's held-out loss: unigram and bigram over GPT-2's
full vocabulary (every one of the 50,257 tokens gets probability, as the model gives).

- unigram, add-one (Laplace): p(w) = (c(w) + 1) / (N + V);
- bigram, interpolated Kneser–Ney with one absolute discount D = n1 / (n1 + 2·n2) (Ney's
  estimate from the bigram count-of-counts; 0.75 when no pair occurs once), backing off to the continuation unigram, which is
  itself interpolated with the uniform distribution so unseen tokens keep some mass:
    p(w | v) = max(c(v, w) − D, 0) / c(v) + D·N1+(v ·) / c(v) · p_cont(w)
    p_cont(w) = max(N1+(· w) − D, 0) / N1+(· ·) + D·|{w : N1+(· w) > 0}| / N1+(· ·) · 1/V
  and p(w | v) = p_cont(w) for a context v never seen in training.
"""

from __future__ import annotations

import numpy as np

DEFAULT_DISCOUNT = 0.75


def pairs(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(previous token, token) for every position after the first."""
    return stream[:-1].astype(np.int64), stream[1:].astype(np.int64)


class UnigramAddOne:
    def __init__(self, train: np.ndarray, vocab_size: int) -> None:
        counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
        self.log_prob = np.log((counts + 1.0) / (len(train) + vocab_size))

    def nll(self, previous: np.ndarray, targets: np.ndarray) -> float:
        """Mean negative log-likelihood (nats per token) of the targets."""
        return float(-self.log_prob[targets].mean())


class BigramKneserNey:
    def __init__(self, train: np.ndarray, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        previous, targets = pairs(train)
        keys, counts = np.unique(previous * vocab_size + targets, return_counts=True)
        self.keys, self.counts = keys, counts.astype(np.float64)
        n1, n2 = (counts == 1).sum(), (counts == 2).sum()
        # Ney's estimate is 0 (no mass left for unseen pairs) when no pair occurs once.
        self.discount = float(n1 / (n1 + 2 * n2)) if n1 else DEFAULT_DISCOUNT
        contexts, followers = keys // vocab_size, keys % vocab_size
        self.context_count = np.bincount(previous, minlength=vocab_size).astype(np.float64)
        self.context_types = np.bincount(contexts, minlength=vocab_size).astype(np.float64)
        continuation = np.bincount(followers, minlength=vocab_size).astype(np.float64)  # N1+(· w)
        total_types = len(keys)  # N1+(· ·)
        d = self.discount
        self.p_cont = (
            np.maximum(continuation - d, 0.0) / total_types
            + d * (continuation > 0).sum() / total_types / vocab_size
        )

    def probabilities(self, previous: np.ndarray, targets: np.ndarray) -> np.ndarray:
        keys = previous * self.vocab_size + targets
        where = np.searchsorted(self.keys, keys).clip(max=len(self.keys) - 1)
        bigram = np.where(self.keys[where] == keys, self.counts[where], 0.0)
        seen = self.context_count[previous] > 0
        context = np.where(seen, self.context_count[previous], 1.0)
        d = self.discount
        interpolated = np.maximum(bigram - d, 0.0) / context + d * self.context_types[previous] / context * self.p_cont[targets]
        return np.where(seen, interpolated, self.p_cont[targets])

    def nll(self, previous: np.ndarray, targets: np.ndarray) -> float:
        """Mean negative log-likelihood (nats per token) of the targets given the previous tokens."""
        return float(-np.log(self.probabilities(previous, targets)).mean())
