"""model/scoring.py: alternatives and ranks ordered by the log-probabilities reported, equal ones
lowest id first, against a plain statement of that order (`top_n`)."""

from __future__ import annotations

import torch

from model.scoring import score_tokens, top_alternatives, top_n


def logits_whose_log_probs_tie() -> torch.Tensor:
    """[2, V]: two logits apart (0 at id 7, -1e-7 at id 3) among many equal ones, so that both
    round to one log-probability (ulp(log V) is ~1e-6)."""
    logits = torch.full((2, 50_000), -1.0)
    logits[:, 7], logits[:, 3] = 0.0, -1e-7
    logits[1, 11] = -float("inf")  # a masked token: last
    return logits


def test_alternatives_rank_the_log_probs_reported_not_the_logits():
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(-4, 4, (3, 300), generator=generator).float(),  # ties
            torch.randn(3, 300, generator=generator) * 5, logits_whose_log_probs_tie()]
    for logits in rows:
        log_probs = logits.log_softmax(dim=-1)
        for n in (1, 5, 17):
            ids, values = top_alternatives(logits, n)
            expected_values, expected_ids = top_n(log_probs, n)
            assert torch.equal(ids, expected_ids) and torch.equal(values, expected_values)
    ids, values = top_alternatives(logits_whose_log_probs_tie(), 2)
    assert values[0, 0] == values[0, 1] and ids[0].tolist() == [3, 7]  # the logits would put 7 first


def test_a_prompt_tokens_rank_counts_strictly_more_likely_tokens_by_log_prob():
    logits = logits_whose_log_probs_tie()
    scores = score_tokens(logits, torch.tensor([7, 3]), 3)
    assert scores.ranks.tolist() == [1, 1]  # 3 and 7 equally likely as reported: neither before the other
    assert scores.top_ids[0, :2].tolist() == [3, 7]
    assert torch.equal(scores.top_logprobs, logits.log_softmax(dim=-1).gather(1, scores.top_ids))
    assert torch.equal(scores.logprobs, logits.log_softmax(dim=-1)[[0, 1], [7, 3]])
