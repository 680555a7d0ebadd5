"""Decoding controls reach the engine from both APIs: greedy answers equal transformers'
generate() with the same controls (the engine's own tests cover each control in depth)."""

from __future__ import annotations

import torch

PROMPT = "The cat sat on the mat. The cat sat on the"
EOS = 50256


@torch.no_grad()
def generate(reference, ids: list[int], new: int, **kwargs) -> list[int]:
    prompt = torch.tensor([ids])  # [1, T]
    out = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             pad_token_id=EOS, **kwargs)
    return out[0, len(ids):].tolist()


def test_openai_controls_equal_transformers(client, reference, tokenizer):
    ids = tokenizer.encode(PROMPT)
    plain = generate(reference, ids, 8)
    bias = {str(plain[0]): -5.0, str(EOS): 20.0}
    body = {"model": "gpt2", "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "no_repeat_ngram_size": 2, "logit_bias": bias, "min_tokens": 3, "bad_words_ids": [[plain[2]]]}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    want = generate(reference, ids, 8, no_repeat_ngram_size=2, min_new_tokens=3, bad_words_ids=[[plain[2]]],
                    sequence_bias=[[[plain[0]], -5.0], [[EOS], 20.0]])
    assert want != plain  # the controls matter here
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in want]
    assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)


def test_tgi_controls_equal_transformers(client, reference, tokenizer):
    ids = tokenizer.encode(PROMPT)
    plain = generate(reference, ids, 8)
    parameters = {"max_new_tokens": 8, "details": True, "no_repeat_ngram_size": 3,
                  "stop_token_ids": [plain[4]], "bad_words_ids": [[plain[0], plain[1]]]}
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    tokens = [t["id"] for t in response.json()["details"]["tokens"]]
    want = generate(reference, ids, 8, no_repeat_ngram_size=3, eos_token_id=[EOS, plain[4]],
                    bad_words_ids=[[plain[0], plain[1]]])
    assert tokens == want
