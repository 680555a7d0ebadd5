"""The count baselines are distributions over the whole vocabulary, and KN's discount is Ney's."""

from __future__ import annotations

import numpy as np

from weights.ngram import BigramKneserNey, UnigramAddOne

VOCAB = 40


def test_unigram_add_one_sums_to_one_and_counts():
    train = np.array([1, 1, 2, 3, 3, 3])
    model = UnigramAddOne(train, VOCAB)
    assert np.isclose(np.exp(model.log_prob).sum(), 1.0)
    assert np.isclose(np.exp(model.log_prob[3]), 4 / (6 + VOCAB))


def test_bigram_kneser_ney_is_a_distribution_for_every_context():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 12, 500)  # tokens 12..39 never seen, context 39 never seen
    model = BigramKneserNey(train, VOCAB)
    everything = np.arange(VOCAB)
    for context in (0, 5, 39):
        p = model.probabilities(np.full(VOCAB, context), everything)
        assert np.isclose(p.sum(), 1.0), context
        assert (p > 0).all()
    keys, counts = np.unique(train[:-1] * VOCAB + train[1:], return_counts=True)
    n1, n2 = (counts == 1).sum(), (counts == 2).sum()
    assert np.isclose(model.discount, n1 / (n1 + 2 * n2))


def test_bigram_beats_unigram_on_text_with_structure():
    train = np.tile([4, 7, 9, 2], 100)
    test = np.tile([4, 7, 9, 2], 5)
    previous, targets = test[:-1], test[1:]
    assert BigramKneserNey(train, VOCAB).nll(previous, targets) < 0.5 < UnigramAddOne(train, VOCAB).nll(previous, targets)
