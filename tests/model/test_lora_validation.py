"""adapter_config.json and the tensors read as data (model/lora_config.py, model/lora_format.py): any
file an operator or an admin client can hand the reader is refused with an AdapterError whose one
line names the option or the tensor, never another exception, and a refusal changes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from model.lora import LoraSet
from model.lora_config import MAX_CONFIG_BYTES, MAX_ITEMS, MAX_NESTING, MAX_PATTERN_CHARS, MAX_RANK, nesting_depth
from model.lora_format import CONFIG_FILE, AdapterError, read_adapter
from tests.model.test_lora import C_ATTN_A, C_ATTN_B, PEFT_CONFIGS, edit_tensors, peft_adapter
from tests.model.test_lora import small_dir  # noqa: F401  (a fixture)
from weights.checkpoint import load_model

pytest.importorskip("peft")

DEEP = 100_000


class Raw(str):
    """An option's value as JSON text, written as it is (it need not be valid JSON)."""


# Each spoiled config is the peft-written one with these options replaced (`...` removes one);
# then the words its refusal must hold.
MALFORMED = {
    # The six that took the engine core down (re.error, TypeError, RecursionError).
    "target_modules an invalid regex": ({"target_modules": "("}, ["target_modules", "not a valid regular expression"]),
    "layers_to_transform a string": ({"layers_to_transform": "abc"}, ["layers_to_transform", '"abc"']),
    "target_modules a number": ({"target_modules": 5}, ["target_modules", "got 5"]),
    "rank_pattern key an invalid regex": ({"rank_pattern": {"(": 4}}, ["rank_pattern", "not a valid regular expression"]),
    "alpha_pattern value a string": ({"alpha_pattern": {"c_attn": "x"}}, ["alpha_pattern", '"x"']),
    "100,000-deep array": ({"target_modules": Raw("[" * DEEP + "]" * DEEP)}, ["nested", str(DEEP + 1), str(MAX_NESTING)]),
    # Each option's type.
    "r a string": ({"r": "8"}, ["option r", '"8"']),
    "r a boolean": ({"r": True}, ["option r", "got true"]),
    "r zero": ({"r": 0}, ["option r", "positive"]),
    "r a float": ({"r": 8.0}, ["option r", "8.0"]),
    "r null": ({"r": None}, ["option r", "got null"]),
    "r missing": ({"r": ...}, ["option r", "missing"]),
    "r past the schema's cap": ({"r": MAX_RANK + 1}, ["option r", str(MAX_RANK)]),
    "r of 5,000 digits": ({"r": Raw("9" * 5000)}, [CONFIG_FILE, "not valid JSON"]),
    "lora_alpha a string": ({"lora_alpha": "16"}, ["lora_alpha", "finite number"]),
    "lora_alpha NaN": ({"lora_alpha": math.nan}, ["lora_alpha", "NaN"]),
    "lora_alpha past a double": ({"lora_alpha": Raw("1e999")}, ["lora_alpha", "finite number"]),
    "use_rslora a string": ({"use_rslora": "yes"}, ["use_rslora", '"yes"']),
    "fan_in_fan_out a number": ({"fan_in_fan_out": 1}, ["fan_in_fan_out", "got 1"]),
    "use_dora a string": ({"use_dora": "no"}, ["use_dora", '"no"']),
    "bias a number": ({"bias": 3}, ["option bias", "got 3"]),
    "init_lora_weights a number": ({"init_lora_weights": 3}, ["init_lora_weights", "got 3"]),
    "peft_type a list": ({"peft_type": ["LORA"]}, ["peft_type", '["LORA"]']),
    "target_modules a list holding a number": ({"target_modules": ["c_attn", 5]}, ["target_modules"]),
    "target_modules nested lists": ({"target_modules": [["c_attn"]]}, ["target_modules"]),
    "exclude_modules an invalid regex": ({"exclude_modules": "[a-"}, ["exclude_modules", "not a valid regular expression"]),
    "exclude_modules a number": ({"exclude_modules": 3}, ["exclude_modules", "got 3"]),
    "layers_to_transform holding a string": ({"layers_to_transform": [0, "1"]}, ["layers_to_transform"]),
    "layers_to_transform negative": ({"layers_to_transform": -1}, ["layers_to_transform", "got -1"]),
    "layers_pattern a number": ({"layers_pattern": 7}, ["layers_pattern", "got 7"]),
    "rank_pattern a list": ({"rank_pattern": ["c_fc"]}, ["rank_pattern"]),
    "rank_pattern value a string": ({"rank_pattern": {"c_fc": "6"}}, ["rank_pattern", '"6"']),
    "rank_pattern value zero": ({"rank_pattern": {"c_fc": 0}}, ["rank_pattern", "positive"]),
    "alpha_pattern key an invalid regex": ({"alpha_pattern": {"c_attn)": 3}}, ["alpha_pattern", "c_attn)", "not a valid regular expression"]),
    "alpha_pattern value infinite": ({"alpha_pattern": {"c_attn": math.inf}}, ["alpha_pattern", "finite number"]),
    # Sizes.
    "target_modules a huge list": ({"target_modules": ["c_attn"] * (MAX_ITEMS + 1)}, ["target_modules", str(MAX_ITEMS), f"{MAX_ITEMS + 1} entries"]),
    "target_modules an over-long regex": ({"target_modules": "c_attn|" * MAX_PATTERN_CHARS}, ["target_modules", str(MAX_PATTERN_CHARS), f"a string of {7 * MAX_PATTERN_CHARS} characters"]),
    "layers_to_transform a huge list": ({"layers_to_transform": list(range(MAX_ITEMS + 1))}, ["layers_to_transform", str(MAX_ITEMS), f"{MAX_ITEMS + 1} entries"]),
    "rank_pattern with too many keys": ({"rank_pattern": {f"x{i}": 4 for i in range(MAX_ITEMS + 1)}}, ["rank_pattern", str(MAX_ITEMS), f"{MAX_ITEMS + 1} entries"]),
    "a file past the size cap": ({"base_model_name_or_path": "x" * MAX_CONFIG_BYTES}, [CONFIG_FILE, "larger than"]),
    "deep nesting in an ignored option": ({"loftq_config": Raw("[" * 40 + "]" * 40)}, ["nested 41 levels"]),
    "an unknown option of a huge value": ({"lora_frobnicate": list(range(10_000))}, ["lora_frobnicate", "not supported", "characters)"]),
    # Ranks the base cannot hold, and regexes that would stall the reader.
    "r past the base's width": ({"r": 33}, ["h.0.attn.c_attn", "rank 33", "min(32, 96)"]),
    "rank_pattern past the base's width": ({"rank_pattern": {"c_fc": 40}}, ["h.0.mlp.c_fc", "rank 40", "min(32, 48)"]),
    "a POSIX class, which regex would read as one": ({"target_modules": "[[:alpha:]]"}, ["target_modules", "[:class:]"]),
    "fuzzy braces, which regex would read as such": ({"exclude_modules": "c_attn{e<=1}"}, ["exclude_modules", "no repeat count"]),
    "catastrophic target_modules regex": ({"target_modules": "(?:.*?){25}[^n]"}, ["target_modules", "(?:.*?){25}[^n]", "takes over"]),
}


def write_spoiled(folder: Path, source: Path, changes: dict) -> Path:
    """A copy of `source` whose config has `changes`."""
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((source / CONFIG_FILE).read_text())
    raw = {}
    for key, value in changes.items():
        if value is ...:
            del config[key]
            continue
        if isinstance(value, Raw):
            raw[key] = value
            value = f"@{key}@"
        config[key] = value
    text = json.dumps(config)
    for key, value in raw.items():
        text = text.replace(json.dumps(f"@{key}@"), value)
    (folder / CONFIG_FILE).write_text(text)
    return folder


@pytest.fixture(scope="module")
def adapter(small_dir, tmp_path_factory) -> Path:  # noqa: F811
    return peft_adapter(tmp_path_factory.mktemp("adapter"), small_dir, **PEFT_CONFIGS["all-modules"])


@pytest.fixture
def loaded(small_dir, adapter) -> LoraSet:  # noqa: F811
    """A set already holding one adapter: a refusal must leave it as it is."""
    adapters = LoraSet(load_model(small_dir))
    adapters.load("good", adapter)
    return adapters


def assert_refused(adapters: LoraSet, folder: Path, words: list[str]) -> str:
    before = (adapters.names, adapters.nbytes("good"))
    with pytest.raises(AdapterError) as refused:  # any other exception fails the test
        adapters.load("bad", folder)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 600, message
    assert all(word in message for word in words), message
    assert (adapters.names, adapters.nbytes("good")) == before
    return message


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_config_is_refused_naming_the_option(case, loaded, adapter, tmp_path):
    changes, words = MALFORMED[case]
    assert_refused(loaded, write_spoiled(tmp_path / "bad", adapter, changes), words)


def test_nesting_is_measured_without_recursion_and_ignores_brackets_in_strings():
    assert nesting_depth('{"a": [[1], {"b": "[[[[{{{"}], "c": "\\"]]"}') == 3
    assert nesting_depth("[" * DEEP) == DEEP


NON_FINITE = {
    "NaN in lora_B, float32": (C_ATTN_B, torch.float32, math.nan),
    "inf in lora_A, bfloat16": (C_ATTN_A, torch.bfloat16, math.inf),
    "-inf in lora_B, float16": (C_ATTN_B, torch.float16, -math.inf),
    "NaN in lora_A, float8": (C_ATTN_A, torch.float8_e4m3fn, math.nan),
}


@pytest.mark.parametrize("case", NON_FINITE)
def test_a_non_finite_tensor_is_refused_naming_it(case, loaded, adapter, tmp_path):
    key, dtype, value = NON_FINITE[case]
    folder = write_spoiled(tmp_path / "bad", adapter, {})

    def spoil(tensors):
        tensors[key] = tensors[key].to(dtype)
        tensors[key][1, 2] = value

    edit_tensors(folder, spoil)
    message = assert_refused(loaded, folder, [f"tensor {key}", "non-finite"])
    assert message.startswith(f"tensor {key}: holds non-finite values (NaN or inf)")


def test_a_finite_adapter_of_a_narrow_dtype_still_loads(loaded, adapter, tmp_path):
    folder = write_spoiled(tmp_path / "narrow", adapter, {})
    edit_tensors(folder, lambda tensors: tensors.update({k: t.to(torch.float8_e4m3fn) for k, t in tensors.items()}))
    assert loaded.load("narrow", folder) == 1


def test_values_and_scalings_past_the_model_dtype_are_refused(small_dir, adapter, tmp_path):  # noqa: F811
    half = load_model(small_dir).to(torch.float16)
    adapters = LoraSet(half)
    adapters.load("good", adapter)
    large = write_spoiled(tmp_path / "large", adapter, {})
    edit_tensors(large, lambda tensors: tensors[C_ATTN_B].__setitem__((0, 0), 1e6))  # finite in float32, inf in float16
    assert_refused(adapters, large, ["'bad'", "h.0.attn.c_attn", "lora_B", "torch.float16"])
    # lora_alpha / r = 1e6 / 8 fits float32 but not float16; 1e40 / 8 fits a double but not float32.
    assert_refused(adapters, write_spoiled(tmp_path / "alpha", adapter, {"lora_alpha": 1e6}), ["scaling 125000", "torch.float16"])
    adapters = LoraSet(load_model(small_dir))
    adapters.load("good", adapter)
    assert_refused(adapters, write_spoiled(tmp_path / "alpha32", adapter, {"lora_alpha": 1e40}), ["scaling 1.25e+39", "torch.float32"])


def test_a_refusal_after_some_sites_were_made_resident_changes_nothing(loaded, adapter, tmp_path):
    """The last site's tensor fails the dtype check after the earlier ones were copied: the set
    keeps no trace of them, and the next adapter gets the next index."""
    bad = write_spoiled(tmp_path / "bad", adapter, {"alpha_pattern": {"h.2.mlp.c_proj": 1e40}})
    assert list(read_adapter(bad, loaded.config).sites)[-1] == "h.2.mlp.c_proj"
    assert_refused(loaded, bad, ["h.2.mlp.c_proj", "scaling"])
    assert loaded.load("next", adapter) == 1 and loaded.names == ["good", "next"]


def test_options_as_peft_writes_them_still_load(loaded, adapter, tmp_path):
    """Nulls, empty patterns and the training-only options are what peft writes: not refused."""
    options = {"exclude_modules": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
               "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "lora_dropout": 0.1, "loftq_config": {},
               "eva_config": None, "init_lora_weights": "gaussian", "peft_version": "0.21.2"}
    assert loaded.load("as-written", write_spoiled(tmp_path / "ok", adapter, options)) == 1
    every_site = r".*\.h\.\d{1,2}\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"  # a repeat count: braces that stay
    assert loaded.load("by-regex", write_spoiled(tmp_path / "regex", adapter, {"target_modules": every_site})) == 2
