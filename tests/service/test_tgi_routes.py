"""TGI's /generate, /generate_stream and / against a direct greedy computation on transformers'
model with the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.service.conftest import (
    LOGPROB_TOLERANCE,
    greedy_reference,
    prompt_logprobs_reference,
    sse_payloads,
)

PROMPTS = ["The quick brown fox", "Hello", "In 1997, the committee decided that the new bridge"]


def generate(client, inputs, **parameters):
    response = client.post("/generate", json={"inputs": inputs, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(response.iter_lines())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_details_match_reference(client, reference, tokenizer, prompt):
    out = generate(client, prompt, max_new_tokens=12, details=True, decoder_input_details=True)
    prompt_ids = tokenizer.encode(prompt)
    ids, logprobs = greedy_reference(reference, prompt_ids, 12, tokenizer.eos_token_id)
    details = out["details"]
    assert [t["id"] for t in details["tokens"]] == ids
    assert out["generated_text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert details["generated_tokens"] == len(ids)
    assert details["finish_reason"] == ("eos_token" if ids[-1] == tokenizer.eos_token_id else "length")
    assert details["seed"] is None  # greedy: no randomness to report
    for token, expected in zip(details["tokens"], logprobs):
        assert token["logprob"] == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
        assert token["text"] == tokenizer.decode([token["id"]])
        assert token["special"] == (token["id"] == tokenizer.eos_token_id)
    # Prefill: every prompt token, the first without a log-prob (nothing precedes it).
    prefill = details["prefill"]
    assert [t["id"] for t in prefill] == prompt_ids
    assert prefill[0]["logprob"] is None
    expected_prefill = prompt_logprobs_reference(reference, prompt_ids)
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(expected_prefill, abs=LOGPROB_TOLERANCE)


def test_without_details_only_text(client, tokenizer, reference):
    out = generate(client, PROMPTS[0], max_new_tokens=5)
    assert set(out) == {"generated_text"}
    ids, _ = greedy_reference(reference, tokenizer.encode(PROMPTS[0]), 5, tokenizer.eos_token_id)
    assert out["generated_text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_list_inputs_answered_as_list_in_order(client):
    singles = [generate(client, p, max_new_tokens=6, details=True) for p in PROMPTS]
    together = generate(client, PROMPTS, max_new_tokens=6, details=True)
    assert isinstance(together, list) and len(together) == len(PROMPTS)
    # Batched together, the same greedy answers (log-probs up to the batch's summation order).
    for single, batched in zip(singles, together):
        assert batched["generated_text"] == single["generated_text"]
        assert [t["id"] for t in batched["details"]["tokens"]] == [t["id"] for t in single["details"]["tokens"]]
        assert [t["logprob"] for t in batched["details"]["tokens"]] == pytest.approx(
            [t["logprob"] for t in single["details"]["tokens"]], abs=LOGPROB_TOLERANCE
        )


def test_return_full_text_prepends_prompt(client):
    plain = generate(client, PROMPTS[1], max_new_tokens=4)
    full = generate(client, PROMPTS[1], max_new_tokens=4, return_full_text=True)
    assert full["generated_text"] == PROMPTS[1] + plain["generated_text"]


def test_stop_sequence_cuts_text(client):
    free = generate(client, PROMPTS[0], max_new_tokens=20, ignore_eos=True)["generated_text"]
    assert len(free) > 8
    stop = free[3:6]  # a string the greedy text contains (maybe split across tokens)
    out = generate(client, PROMPTS[0], max_new_tokens=20, ignore_eos=True, stop=[stop], details=True)
    assert out["generated_text"] == free[: free.index(stop)]
    assert out["details"]["finish_reason"] == "stop_sequence"


def test_truncate_keeps_last_prompt_tokens(client, tokenizer):
    prompt = PROMPTS[2]
    ids = tokenizer.encode(prompt)
    out = generate(client, prompt, max_new_tokens=3, truncate=4, details=True, decoder_input_details=True)
    assert [t["id"] for t in out["details"]["prefill"]] == ids[-4:]
    direct = generate(client, tokenizer.decode(ids[-4:]), max_new_tokens=3)
    assert out["generated_text"] == direct["generated_text"]


def test_seeded_sampling_reproducible_and_reported(client):
    params = dict(max_new_tokens=8, do_sample=True, temperature=1.5, top_k=50, seed=1234, details=True)
    first, second = generate(client, PROMPTS[0], **params), generate(client, PROMPTS[0], **params)
    assert first == second
    assert first["details"]["seed"] == 1234
    unseeded = generate(client, PROMPTS[0], **{**params, "seed": None})
    assert isinstance(unseeded["details"]["seed"], int)  # the seed drawn is reported back


def test_num_return_sequences_gives_a_list(client):
    out = generate(client, PROMPTS[0], max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=7, details=True)
    assert isinstance(out, list) and len(out) == 3
    assert all(o["details"]["generated_tokens"] >= 1 for o in out)


def test_best_of_returns_most_likely_candidate(client):
    out = generate(client, PROMPTS[0], max_new_tokens=6, do_sample=True, best_of=3, seed=11, details=True)
    others = out["details"]["best_of_sequences"]
    assert len(others) == 2

    def total(details):
        return sum(t["logprob"] for t in details["tokens"])

    assert all(total(out["details"]) >= total(o) for o in others)
    assert all(o["generated_tokens"] == len(o["tokens"]) for o in others)


def test_beam_search_matches_transformers(client, reference, tokenizer):
    prompt_ids = tokenizer.encode(PROMPTS[0])
    out = generate(client, PROMPTS[0], max_new_tokens=6, num_beams=3, details=True)
    config = GenerationConfig(
        max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt_ids]), generation_config=config)[0, len(prompt_ids):]
    expected = expected.tolist()
    got = [t["id"] for t in out["details"]["tokens"]]
    # transformers pads a beam that ended early with pad (= eos) tokens.
    assert got == expected[: len(got)] and set(expected[len(got):]) <= {tokenizer.eos_token_id}


def test_stream_matches_generate(client, tokenizer):
    body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 10, "details": True}}
    whole = generate(client, PROMPTS[2], max_new_tokens=10, details=True)
    events = stream(client, "/generate_stream", body)
    assert len(events) == whole["details"]["generated_tokens"]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == whole["generated_text"]
    assert last["details"]["finish_reason"] == whole["details"]["finish_reason"]
    assert last["details"]["generated_tokens"] == len(events)
    assert last["details"]["input_length"] == len(tokenizer.encode(PROMPTS[2]))


def test_stream_without_details(client):
    events = stream(client, "/generate_stream", {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 3}})
    assert events[-1]["details"] is None and isinstance(events[-1]["generated_text"], str)


def test_compat_route_dispatches_on_stream(client):
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 4}}
    plain = client.post("/", json=body).json()
    assert plain == generate(client, PROMPTS[1], max_new_tokens=4)
    events = stream(client, "/", {**body, "stream": True})
    assert events[-1]["generated_text"] == plain["generated_text"]
