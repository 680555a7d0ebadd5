"""config.json compatibility with transformers, and configs that must be refused."""

from __future__ import annotations

import json

import pytest
from transformers import GPT2Config as HFGPT2Config

from model.config import GPT2Config

FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon")


def test_reads_the_config_transformers_writes(tmp_path):
    written = HFGPT2Config(n_embd=48, n_layer=5, n_head=6, n_positions=77, n_inner=99,
                           layer_norm_epsilon=3e-4, vocab_size=1234)
    written.save_pretrained(tmp_path)
    ours = GPT2Config.from_json(tmp_path / "config.json")
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(written, f) for f in FIELDS}


def test_transformers_reads_the_config_we_write():
    ours = GPT2Config(n_embd=48, n_layer=5, n_head=6, n_positions=77, n_inner=99)
    theirs = HFGPT2Config(**ours.to_hf_dict())
    assert {f: getattr(theirs, f) for f in FIELDS} == {f: getattr(ours, f) for f in FIELDS}
    assert theirs.tie_word_embeddings is True


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"n_layer": 2.0}, "n_layer"),
        ({"n_head": "12"}, "n_head"),
        ({"n_embd": 0}, "n_embd"),
        ({"n_inner": -1}, "n_inner"),
        ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon"),
        ({"n_embd": 100, "n_head": 12}, "divisible"),
        ({"activation_function": "prelu"}, "activation_function 'prelu'"),
        ({"activation_function": "xielu"}, "activation_function 'xielu'"),
        ({"activation_function": "softmax"}, "activation_function 'softmax'"),
        ({"model_type": "llama"}, "model_type"),
        ({"scale_attn_weights": "no"}, "scale_attn_weights"),
        ({"scale_attn_by_inverse_layer_idx": 1}, "scale_attn_by_inverse_layer_idx"),
        ({"reorder_and_upcast_attn": None}, "reorder_and_upcast_attn"),
        ({"add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_bad_config_is_refused_naming_file_and_key(tmp_path, changes, named):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2Config().to_hf_dict(), **changes}))
    with pytest.raises(ValueError) as caught:
        GPT2Config.from_json(path)
    assert str(path) in str(caught.value) and named in str(caught.value)


def test_config_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        GPT2Config.from_json(path)


def test_harmless_options_are_accepted():
    # Options that change training or heads we do not build, not inference arithmetic.
    config = GPT2Config.from_dict({"resid_pdrop": 0.3, "summary_type": "mean", "use_cache": False, "n_ctx": 1024})
    assert config == GPT2Config()


ARITHMETIC_OPTIONS = {"activation_function": "gelu", "scale_attn_weights": False,
                      "scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True}


def test_arithmetic_options_are_read_and_written_back(tmp_path):
    """The options model/attention.py and model/activations.py compute are kept, not dropped,
    and a config written here gives transformers the same ones."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2Config().to_hf_dict(), **ARITHMETIC_OPTIONS}))
    ours = GPT2Config.from_json(path)
    assert {key: getattr(ours, key) for key in ARITHMETIC_OPTIONS} == ARITHMETIC_OPTIONS
    theirs = HFGPT2Config(**ours.to_hf_dict())
    assert {key: getattr(theirs, key) for key in ARITHMETIC_OPTIONS} == ARITHMETIC_OPTIONS
