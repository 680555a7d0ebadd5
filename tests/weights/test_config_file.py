"""The config.json we write is the one transformers writes (every key, same values), plus n_ctx."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig
from transformers import GPT2Config as HFGPT2Config
from transformers import OpenAIGPTConfig

from model.config import PRESETS, GPT2Config
from model.post_ln import PRESETS as POST_LN_PRESETS
from tests.conftest import TINY
from weights.checkpoint import CONFIG_FILE, load_model

# The key transformers stamps with its own version: we write no such claim, transformers did not
# write the file.
NOT_WRITTEN = {"transformers_version"}


def transformers_writes(config_class, **values) -> dict:
    """`config_class(**values).to_dict()` as it reads back from JSON (id2label's keys are strings)."""
    written = json.loads(json.dumps(config_class(**values).to_dict()))
    return {k: v for k, v in written.items() if k not in NOT_WRITTEN}


def shape_of(config) -> dict:
    names = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon")
    return {name: getattr(config, name) for name in names if hasattr(config, name)}


@pytest.mark.parametrize("name", ["gpt2", "distilgpt2"])
def test_the_default_config_is_the_one_transformers_writes_plus_n_ctx(name):
    config = PRESETS[name]
    ours = config.to_hf_dict(dtype="float32")
    theirs = transformers_writes(HFGPT2Config, **shape_of(config), architectures=["GPT2LMHeadModel"], dtype="float32")
    assert set(ours) - set(theirs) == {"n_ctx"}, "keys we write that transformers does not"
    assert set(theirs) - set(ours) == set(), "keys transformers writes that we do not"
    assert {k: ours[k] for k in theirs} == theirs
    # The hub's GPT-2 configs carry n_ctx (older transformers wrote it); llama.cpp's converter reads it.
    assert ours["n_ctx"] == config.n_positions


def test_the_written_folder_config_is_the_one_transformers_writes(tiny_model_dir):
    ours = json.loads((tiny_model_dir / CONFIG_FILE).read_text())
    theirs = transformers_writes(HFGPT2Config, **shape_of(TINY), architectures=["GPT2LMHeadModel"], dtype="float32")
    assert {k: v for k, v in ours.items() if k != "n_ctx"} == theirs
    assert ours["n_ctx"] == TINY.n_positions
    loaded = AutoConfig.from_pretrained(tiny_model_dir)
    assert (loaded.model_type, loaded.n_positions, loaded.n_embd) == ("gpt2", TINY.n_positions, TINY.n_embd)


def test_the_post_ln_config_is_the_one_transformers_writes():
    config = POST_LN_PRESETS["openai-gpt"]
    ours = config.to_hf_dict(dtype="float32")
    theirs = transformers_writes(OpenAIGPTConfig, architectures=["OpenAIGPTLMHeadModel"], dtype="float32")
    assert ours == theirs


def test_a_folder_written_before_n_ctx_still_loads(tiny_model_dir, tmp_path):
    # Folders prepared by earlier versions carry only these keys; `make weights` keeps a prepared
    # folder as it is, so they must keep loading.
    old = shutil.copytree(tiny_model_dir, tmp_path / "old")
    keys = {*shape_of(TINY), "activation_function", "initializer_range", "bos_token_id", "eos_token_id",
            "model_type", "architectures", "tie_word_embeddings"}
    written = json.loads((old / CONFIG_FILE).read_text())
    (old / CONFIG_FILE).write_text(json.dumps({k: v for k, v in written.items() if k in keys}))
    assert load_model(old).config == GPT2Config.from_json(tiny_model_dir / CONFIG_FILE) == TINY
