"""Scoring and alternatives: OpenAI echo + max_tokens=0 + logprobs=N, vLLM's prompt_logprobs,
TGI's top_n_tokens; every value against log-softmax of transformers' logits on the same folder."""

from __future__ import annotations

import pytest
import torch

from tests.service.conftest import LOGPROB_TOLERANCE, greedy_reference, sse_payloads

PROMPT = "The quick brown fox jumps over the lazy dog because"


@torch.no_grad()
def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position: [T, V]."""
    return reference(torch.tensor([ids])).logits[0].log_softmax(-1)


def top_by_text(row: torch.Tensor, n: int, tokenizer) -> dict[str, float]:
    values, ids = row.topk(n)
    return {tokenizer.decode([int(i)]): float(v) for i, v in zip(ids, values)}


def assert_close_dicts(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert set(expected) <= set(actual), (actual, expected)
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, abs=LOGPROB_TOLERANCE), key


def test_echo_without_generating_scores_the_prompt(client, reference, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"model": "gpt2", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    (choice,) = out["choices"]
    expected = reference_logprobs(reference, ids)  # [T, V]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]  # the prompt only: nothing generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(expected[i - 1, t]) for i, t in enumerate(ids) if i > 0]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert_close_dicts(top, top_by_text(expected[i - 1], 3, tokenizer))
        # the prompt token itself is there too when it is not among the 3
        assert top[lp["tokens"][i]] == pytest.approx(want[i - 1], abs=LOGPROB_TOLERANCE)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_generated_alternatives_match_reference(client, reference, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"model": "gpt2", "prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    lp = response.json()["choices"][0]["logprobs"]
    generated, _ = greedy_reference(reference, ids, 6, None)
    expected = reference_logprobs(reference, ids + generated)  # [T + 6, V]
    assert len(lp["top_logprobs"]) == 6
    for step, top in enumerate(lp["top_logprobs"]):
        row = expected[len(ids) - 1 + step]
        assert_close_dicts(top, top_by_text(row, 2, tokenizer))
        assert max(top.values()) == pytest.approx(lp["token_logprobs"][step], abs=LOGPROB_TOLERANCE)  # greedy


def test_vllm_prompt_logprobs_have_ranks_and_alternatives(client, reference, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"model": "gpt2", "prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]
    expected = reference_logprobs(reference, ids)  # [T, V]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, token = expected[i - 1], ids[i]
        mine = entries[i][str(token)]
        assert mine["logprob"] == pytest.approx(float(row[token]), abs=LOGPROB_TOLERANCE)
        # The rank counts strictly more likely tokens; within the tolerance the order of near-ties
        # (common in a random model's flat distribution) may differ between implementations.
        value = row[token]
        lowest = int((row > value + LOGPROB_TOLERANCE).sum()) + 1
        highest = int((row > value - LOGPROB_TOLERANCE).sum()) + 1
        assert lowest <= mine["rank"] <= highest
        assert mine["decoded_token"] == tokenizer.decode([token])
        values, top_ids = row.topk(2)
        for rank, (value, alternative) in enumerate(zip(values, top_ids), start=1):
            entry = entries[i][str(int(alternative))]
            assert entry["logprob"] == pytest.approx(float(value), abs=LOGPROB_TOLERANCE)
            assert entry["rank"] == rank


def test_tgi_top_n_tokens_whole_and_streamed(client, reference, tokenizer):
    ids = tokenizer.encode(PROMPT)
    parameters = {"max_new_tokens": 4, "details": True, "top_n_tokens": 3, "decoder_input_details": True}
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    generated = [t["id"] for t in details["tokens"]]
    expected = reference_logprobs(reference, ids + generated)  # [T + 4, V]
    assert len(details["top_tokens"]) == len(generated)
    for step, top in enumerate(details["top_tokens"]):
        values, top_ids = expected[len(ids) - 1 + step].topk(3)
        assert [t["id"] for t in top] == top_ids.tolist()
        assert [t["logprob"] for t in top] == pytest.approx(values.tolist(), abs=LOGPROB_TOLERANCE)
        assert [t["text"] for t in top] == [tokenizer.decode([int(i)]) for i in top_ids]
    parameters = {"max_new_tokens": 4, "top_n_tokens": 3}
    with client.stream("POST", "/generate_stream", json={"inputs": PROMPT, "parameters": parameters}) as streamed:
        events = sse_payloads(streamed.iter_lines())
    assert [[t["id"] for t in e["top_tokens"]] for e in events] == [[t["id"] for t in top] for top in details["top_tokens"]]


def test_alternatives_only_for_the_rows_that_ask(client):
    """A call whose prompts share one engine step: logprobs=N for all, none without logprobs."""
    body = {"model": "gpt2", "prompt": ["One prompt", "Another, longer prompt"], "max_tokens": 3, "temperature": 0}
    with_top = client.post("/v1/completions", json={**body, "logprobs": 1}).json()
    without = client.post("/v1/completions", json=body).json()
    assert all(len(c["logprobs"]["top_logprobs"]) == 3 for c in with_top["choices"])
    assert all(c["logprobs"] is None for c in without["choices"])
    assert [c["text"] for c in with_top["choices"]] == [c["text"] for c in without["choices"]]
