"""/tokenize (TGI's and vLLM's request), /detokenize and /tokenizer_info against transformers'
GPT2TokenizerFast reading the same folder."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.conftest import TINY, assert_validation_error

TEXT = "Héllo wörld, 'tis GPT-2 ✓ <|endoftext|> tokens"


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_vllm_tokenize_matches_transformers(client, hf_tokenizer):
    body = {"model": "gpt2", "prompt": TEXT, "add_special_tokens": True, "return_token_strs": True}
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    expected = hf_tokenizer(TEXT)["input_ids"]
    assert out["tokens"] == expected and out["count"] == len(expected)
    assert out["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    assert out["max_model_len"] == TINY.n_positions


def test_tgi_tokenize_still_answers_its_shape(client, hf_tokenizer):
    out = client.post("/tokenize", json={"inputs": TEXT}).json()
    assert [t["id"] for t in out] == hf_tokenizer(TEXT)["input_ids"]
    assert "".join(t["text"] for t in out) == TEXT


def test_detokenize_round_trips_and_matches_transformers(client, hf_tokenizer):
    ids = hf_tokenizer(TEXT)["input_ids"]
    response = client.post("/detokenize", json={"model": "gpt2", "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": hf_tokenizer.decode(ids)}
    assert response.json()["prompt"] == TEXT


def test_tokenizer_info_agrees_with_transformers(client, hf_tokenizer):
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    for name in ("bos_token", "eos_token", "unk_token"):
        assert info[name] == getattr(hf_tokenizer, name)
    assert info["eos_token_id"] == hf_tokenizer.eos_token_id
    assert info["vocab_size"] == len(hf_tokenizer)
    assert info["model_max_length"] == TINY.n_positions


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/detokenize", {"tokens": [TINY.vocab_size]}, ["token id", "vocabulary"]),
        ("/detokenize", {"tokens": [-1]}, ["token id"]),
        ("/detokenize", {"model": "other", "tokens": [1]}, ["model", "not served"]),
        ("/detokenize", {"tokens": "abc"}, ["tokens"]),
        ("/tokenize", {"model": "other", "prompt": "x"}, ["model", "not served"]),
        ("/tokenize", {"prompt": ""}, ["prompt"]),
    ],
)
def test_bad_tokenizer_requests_are_422(client, path, body, words):
    assert_validation_error(client.post(path, json=body), *words)
