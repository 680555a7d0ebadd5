"""OpenAI's /v1/completions and /v1/models, in-process, against the same greedy reference."""

from __future__ import annotations

import pytest

from tests.service.conftest import LOGPROB_TOLERANCE, greedy_reference, prompt_logprobs_reference, sse_payloads

PROMPT = "Once upon a time"


def complete(client, **body):
    response = client.post("/v1/completions", json={"model": "gpt2", "prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["gpt2"]


def test_greedy_completion_matches_reference(client, reference, tokenizer):
    out = complete(client, max_tokens=10, temperature=0, logprobs=0)
    ids, logprobs = greedy_reference(reference, tokenizer.encode(PROMPT), 10, tokenizer.eos_token_id)
    (choice,) = out["choices"]
    assert out["object"] == "text_completion" and out["model"] == "gpt2"
    assert choice["index"] == 0
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["finish_reason"] == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t in choice["logprobs"]["tokens"][:i]) for i in range(len(ids))]
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "total_tokens": prompt_tokens + len(ids)}


def test_echo_with_logprobs_includes_prompt(client, reference, tokenizer):
    out = complete(client, max_tokens=3, temperature=0, echo=True, logprobs=0)
    plain = complete(client, max_tokens=3, temperature=0)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    prompt_ids = tokenizer.encode(PROMPT)
    lps = choice["logprobs"]["token_logprobs"]
    assert lps[0] is None
    assert lps[1 : len(prompt_ids)] == pytest.approx(prompt_logprobs_reference(reference, prompt_ids), abs=LOGPROB_TOLERANCE)


def test_token_id_prompts_and_n_number_choices(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_ids = complete(client, prompt=ids, max_tokens=4, temperature=0)
    by_text = complete(client, max_tokens=4, temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    # Two prompts × n=2 (sampling): choice i*n + j is completion j of prompt i.
    out = complete(client, prompt=[ids, ids[:2]], n=2, max_tokens=3, temperature=1.0, seed=3)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    # Greedy n=2: both copies of the one answer.
    greedy = complete(client, max_tokens=4, temperature=0, n=2)
    assert [c["text"] for c in greedy["choices"]] == [by_text["choices"][0]["text"]] * 2
    assert greedy["usage"]["completion_tokens"] == 2 * by_text["usage"]["completion_tokens"]


def test_best_of_keeps_n_most_likely(client):
    out = complete(client, max_tokens=4, temperature=1.0, n=1, best_of=3, seed=5, logprobs=0)
    assert len(out["choices"]) == 1
    assert out["usage"]["completion_tokens"] >= len(out["choices"][0]["logprobs"]["tokens"])


def test_stream_concatenates_to_the_completion(client):
    whole = complete(client, max_tokens=8, temperature=0)
    body = {"model": "gpt2", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    text = "".join(c["text"] for chunk in chunks[:-1] for c in chunk["choices"])
    assert text == whole["choices"][0]["text"]
    reasons = [c["finish_reason"] for chunk in chunks[:-1] for c in chunk["choices"] if c["finish_reason"]]
    assert reasons == [whole["choices"][0]["finish_reason"]]
    assert len({chunk["id"] for chunk in chunks}) == 1


@pytest.mark.parametrize("echo", [False, True])
def test_stream_of_several_prompts_and_choices_matches_whole(client, echo):
    body = {"prompt": ["First prompt", "Second one"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 21, "echo": echo}
    whole = complete(client, **body)
    with client.stream("POST", "/v1/completions", json={"model": "gpt2", "stream": True, **body}) as response:
        chunks = [c for c in sse_payloads(response.iter_lines()) if c != "[DONE]"]
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                reasons.setdefault(c["index"], []).append(c["finish_reason"])
    # Seeded: the streamed choices are the same completions, interleaved as they were produced.
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: [c["finish_reason"]] for c in whole["choices"]}
