"""LoRA adapters (model/lora.py, model/lora_format.py): peft's folders load and give peft's logits,
bad folders are refused naming what is wrong, and a batch mixing the base and several adapters
gives every row the bits it gets alone (docs/lora.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import GPT2Config
from model.kv_cache import KVCache
from model.gpt2 import Packing
import model.lora as lora_module
from model.linear import Conv1D
from model.lora import BASE, LoraConv1D, LoraSet, grouped_by_adapter, inverse_of
from model.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError
from model.quantized import quantize_problem
from tests.conftest import write_tiny_model
from tests.model.hf_reference import LOGIT_TOLERANCE, load_reference, random_ids
from weights.checkpoint import load_model

peft = pytest.importorskip("peft")

# Small but with an MLP wider than the embedding (n_inner), so c_fc and the MLP's c_proj differ in shape.
SMALL = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=3, n_head=2, n_inner=48)
PEFT_CONFIGS = {
    "all-modules": dict(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"]),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["c_attn", "c_proj", "c_fc"]),
    "attention-only": dict(r=2, lora_alpha=4, target_modules=["c_attn"]),
    "regex-mlp-projection": dict(r=3, lora_alpha=5, target_modules=r".*\.mlp\.c_proj"),
    "some-layers": dict(r=4, lora_alpha=4, target_modules=["c_fc", "c_proj"], layers_to_transform=[0, 2]),
    "rank-and-alpha-patterns": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                    rank_pattern={"c_fc": 6}, alpha_pattern={"c_attn": 3}),
}


def peft_adapter(folder: Path, model_dir: Path, seed: int = 0, **lora_options) -> Path:
    """An adapter peft itself builds and saves on transformers' GPT-2, with random (nonzero) B."""
    reference = load_reference_model(model_dir)
    options = {"fan_in_fan_out": True, **lora_options}  # what peft needs for GPT-2's Conv1D
    model = peft.get_peft_model(reference, peft.LoraConfig(**options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:  # peft starts B at zero: the adapter would change nothing
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    return folder


def load_reference_model(model_dir: Path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("small"), SMALL)


@pytest.fixture(scope="module")
def small_adapter(small_dir, tmp_path_factory) -> Path:
    return peft_adapter(tmp_path_factory.mktemp("adapter"), small_dir, **PEFT_CONFIGS["all-modules"])


@pytest.mark.parametrize("name", PEFT_CONFIGS)
@torch.inference_mode()
def test_logits_equal_peft_and_its_merged_model(name, small_dir, tmp_path):
    folder = peft_adapter(tmp_path / "adapter", small_dir, **PEFT_CONFIGS[name])
    ids = random_ids(SMALL, batch=2, length=12)
    ours = load_model(small_dir)
    adapters = LoraSet(ours)
    index = adapters.load(name, folder)
    adapted = ours(ids, lora=adapters.rows([index, index])).logits
    # The folder as peft reads it from disk, then the same merged into the base weights.
    reference = peft.PeftModel.from_pretrained(load_reference_model(small_dir), folder).eval()
    expected = reference(ids).logits
    merged = reference.merge_and_unload()(ids).logits
    assert (adapted - expected).abs().max() <= LOGIT_TOLERANCE
    assert (adapted - merged).abs().max() <= LOGIT_TOLERANCE
    # The adapter matters far beyond the tolerance: a dropped delta cannot pass.
    assert (adapted - ours(ids).logits).abs().max() > 100 * LOGIT_TOLERANCE


def test_a_set_holds_each_adapters_own_tensors_by_name_and_index(small_dir, small_adapter, tmp_path):
    model = load_model(small_dir)
    adapters = LoraSet(model)
    first = adapters.load("first", small_adapter)
    second = adapters.load("second", peft_adapter(tmp_path / "second", small_dir, seed=1, **PEFT_CONFIGS["attention-only"]))
    assert (first, second) == (0, 1) and adapters.names == ["first", "second"]
    tensors = load_file(str(small_adapter / WEIGHTS_FILE))
    assert adapters.nbytes("first") == sum(t.nbytes for t in tensors.values())  # no copy of the base
    with pytest.raises(AdapterError, match="already loaded"):
        adapters.load("first", small_adapter)
    adapters.remove("first")
    assert "first" not in adapters and adapters.index("second") == 1
    with pytest.raises(KeyError):
        adapters.rows([0])
    assert adapters.load("third", small_adapter) == 0  # the freed index is reused
    assert adapters.rows([BASE, BASE]) is None  # all base: the forward takes no adapters


@torch.inference_mode()
def test_loading_an_adapter_wraps_the_layers_once_for_every_set_over_the_model(small_dir, small_adapter, tmp_path):
    model = load_model(small_dir)
    ids = random_ids(SMALL, batch=2, length=6)
    plain = model(ids).logits
    first, second = LoraSet(model), LoraSet(model)  # as engines sharing one model build theirs
    assert not any(isinstance(m, LoraConv1D) for m in model.modules())  # nothing served yet: plain layers
    one = first.load("one", small_adapter)
    layers = [m for m in model.modules() if isinstance(m, LoraConv1D)]
    assert len(layers) == 4 * SMALL.n_layer and all(type(layer.base) is Conv1D for layer in layers)
    other = peft_adapter(tmp_path / "other", small_dir, seed=1, **PEFT_CONFIGS["attention-only"])
    two = second.load("two", other)
    assert [m for m in model.modules() if isinstance(m, LoraConv1D)] == layers  # not wrapped twice
    assert torch.equal(model(ids).logits, plain)  # without rows of adapters, the base forward
    # Each set's rows get that set's adapter, exactly as a model serving that adapter alone.
    for adapters, index, folder in ((first, one, small_adapter), (second, two, other)):
        fresh = load_model(small_dir)
        alone = LoraSet(fresh)
        expected = fresh(ids, lora=alone.rows([alone.load("alone", folder)] * 2)).logits
        assert torch.equal(model(ids, lora=adapters.rows([index, index])).logits, expected)


# --- bad folders ------------------------------------------------------------------------------
def edit_config(folder: Path, **changes) -> None:
    path = folder / CONFIG_FILE
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))


C_ATTN_A = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
C_ATTN_B = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"
BAD_FOLDERS = {
    "lora_B missing": (lambda f: edit_tensors(f, lambda t: t.pop(C_ATTN_B)), [C_ATTN_A, "lora_B"]),
    "wrong inputs": (lambda f: edit_tensors(f, lambda t: t.update({C_ATTN_A: torch.zeros(8, 64)})), [C_ATTN_A, "32 inputs"]),
    "wrong rank": (lambda f: edit_tensors(f, lambda t: t.update({C_ATTN_B: torch.zeros(96, 5)})), [C_ATTN_B, "rank"]),
    "DoRA": (lambda f: edit_config(f, use_dora=True), ["use_dora"]),
    "bias all": (lambda f: edit_config(f, bias="all"), ["bias", "all"]),
    "modules_to_save": (lambda f: edit_config(f, modules_to_save=["lm_head"]), ["modules_to_save"]),
    "not LoRA": (lambda f: edit_config(f, peft_type="IA3"), ["peft_type", "IA3"]),
    "no config": (lambda f: (f / CONFIG_FILE).unlink(), [CONFIG_FILE]),
    "pickle, not safetensors": (lambda f: (f / WEIGHTS_FILE).rename(f / "adapter_model.bin"), ["adapter_model.bin", WEIGHTS_FILE]),
    "unknown tensor": (lambda f: edit_tensors(f, lambda t: t.update({"base_model.model.transformer.h.0.attn.q_proj.lora_A.weight": torch.zeros(8, 32)})),
                       ["q_proj.lora_A"]),
    "embedding": (lambda f: edit_tensors(f, lambda t: t.update({"base_model.model.transformer.wte.lora_embedding_A": torch.zeros(8, 300)})),
                  ["transformer.wte.lora_embedding_A", "embedding"]),
    "layer past the base": (lambda f: edit_tensors(f, lambda t: t.update({C_ATTN_A.replace("h.0", "h.7"): torch.zeros(8, 32),
                                                                             C_ATTN_B.replace("h.0", "h.7"): torch.zeros(96, 8)})),
                            ["h.7", "3 layers"]),
    "untargeted module": (lambda f: edit_config(f, target_modules=["c_fc", "c_proj"]), [C_ATTN_A, "target_modules"]),
}


def test_a_forwards_groupings_are_built_once_on_the_host(small_dir, tmp_path, monkeypatch):
    """The layers only some of the batch's adapters adapt share one grouping of the tokens per
    forward, made from host lists like the batch's own: no layer builds indices on the device
    (on a GPU each such build waited for the device). A forward of whole rows runs them grouped
    by adapter, so the layers every adapter of the batch adapts gather nothing, and its logits
    are those of the same rows gathered at every layer, bit for bit."""
    model = load_model(small_dir)
    adapters = LoraSet(model)
    every = adapters.load("every", peft_adapter(tmp_path / "every", small_dir, **PEFT_CONFIGS["all-modules"]))
    attention = adapters.load("attention", peft_adapter(tmp_path / "attention", small_dir, seed=1, **PEFT_CONFIGS["attention-only"]))
    copies = []
    real = lora_module.to_device
    monkeypatch.setattr(lora_module, "to_device", lambda values, device: copies.append(values) or real(values, device))
    ids, lora = random_ids(SMALL, batch=3, length=4), adapters.rows([attention, BASE, every])
    with torch.inference_mode():
        grouped = model(ids, lora=lora).logits
        # The hidden states asked for, the rows keep the batch's order and each layer gathers.
        gathered = model(ids, lora=lora, output_hidden_states=True).logits
    # Rows run as [attention, every, base]: c_attn, which both adapt, needs no grouping; c_proj
    # and c_fc, which only `every` adapts, one, [order, inverse], read by every layer of the 3 blocks.
    assert [len(order) for order, _inverse in copies[:1]] == [12]
    assert list(copies[0][0][:4]) == list(range(4, 8))  # `every`'s tokens (now the second row) first
    # Then the forward in the batch's order: c_attn's grouping and c_proj's and c_fc's.
    assert [len(order) for order, _inverse in copies[1:]] == [12, 12]
    assert torch.equal(grouped, gathered)


def test_tokens_are_grouped_adapter_by_adapter_in_first_appearance_order_the_base_last():
    """grouped_by_adapter's contract, against the statement of it row by row: the tokens (row b
    owning the next tokens_per_row[b]) adapter by adapter, adapters as their first row appears
    (an empty row's too), the base's last, each adapter's tokens in their order, and each
    non-base adapter's slice of the order."""
    chooser = random.Random(0)
    for _ in range(2000):
        rows = [chooser.choice([BASE, BASE, 0, 1, 2, 5]) for _ in range(chooser.randint(0, 40))]
        counts = [chooser.randint(0, 3) for _ in rows] if chooser.random() < 0.5 else None
        starts, start = [], 0
        for count in counts or [1] * len(rows):
            starts.append(range(start, start + count))
            start += count
        adapters = list(dict.fromkeys(a for a in rows if a != BASE)) + ([BASE] if BASE in rows else [])
        expected, spans = [], []
        for adapter in adapters:
            tokens = [t for a, span in zip(rows, starts) if a == adapter for t in span]
            if adapter != BASE:
                spans.append((adapter, len(expected), len(expected) + len(tokens)))
            expected += tokens
        order, found = grouped_by_adapter(rows, counts)
        assert (order.tolist(), found) == (expected, spans)
        assert order[inverse_of(order)].tolist() == list(range(len(order)))


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_bad_folders_are_refused_naming_what_is_wrong(case, small_dir, small_adapter, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    for file in small_adapter.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    spoil, words = BAD_FOLDERS[case]
    spoil(folder)
    model = load_model(small_dir)
    adapters = LoraSet(model)
    with pytest.raises(AdapterError) as refused:
        adapters.load("bad", folder)
    message = str(refused.value)
    assert "\n" not in message
    assert all(word in message for word in words), message
    assert adapters.names == [] and not any(isinstance(m, LoraConv1D) for m in model.modules())  # nothing changed


def test_an_adapter_for_a_wider_base_is_refused(small_dir, tmp_path):
    wider = write_tiny_model(tmp_path / "wider", SMALL.with_(n_embd=64, n_inner=96))
    folder = peft_adapter(tmp_path / "adapter", wider, **PEFT_CONFIGS["all-modules"])
    with pytest.raises(AdapterError, match=r"tensor base_model\.model\.transformer\.h\.0\..*takes 32 inputs"):
        LoraSet(load_model(small_dir)).load("wider", folder)


# --- batches mixing adapters --------------------------------------------------------------------
LENGTHS = [5, 1, 12, 3, 9]
DECODE_STEPS = 3


@pytest.fixture(scope="module", params=["none", "int8", "int4"])
def served(request, tiny_model_dir, tmp_path_factory):
    """The tiny model (quantized or not) with three adapters of different shapes and targets."""
    problem = quantize_problem(request.param, "cpu", torch.float32)
    if problem is not None:
        pytest.skip(problem)
    model = load_model(tiny_model_dir)
    model.quantize(request.param)
    adapters = LoraSet(model)
    for seed, name in enumerate(("all-modules", "rslora", "attention-only")):
        folder = peft_adapter(tmp_path_factory.mktemp(name), tiny_model_dir, seed=seed, **PEFT_CONFIGS[name])
        adapters.load(name, folder)
    return model, adapters


@torch.inference_mode()
def run_batch(model, adapters, prompts, adapter_of_row, use_lora=True):
    """Per row: its prefill logits [n, V] (one packed forward), then [V] per [B, 1] decode step."""
    lora = adapters.rows(adapter_of_row) if use_lora else None
    cache = KVCache(model.config, max_slots=len(prompts), max_len=64)
    cache.allocate(cache.max_slots)  # every row with its blocks, as the engine's running rows
    slots = list(range(len(prompts)))[::-1]
    lengths = [len(p) for p in prompts]
    flat = [(b * max(lengths) + j, slots[b], j) for b, n in enumerate(lengths) for j in range(n)]
    index, token_slots, positions = torch.tensor(flat).t()
    packing = Packing(index, len(prompts), max(lengths), token_slots, positions)
    out = model.forward_packed(torch.tensor(sum(prompts, [])), packing, cache, cache.batch(slots), max(lengths), lora=lora)
    per_row = [[logits] for logits in model.lm_head(out.head_input).split(lengths)]
    tokens = [row[0][-1].argmax().item() for row in per_row]
    for _ in range(DECODE_STEPS):
        logits = model(torch.tensor([[t] for t in tokens]), torch.tensor([[n] for n in lengths]), cache,
                       cache.batch(slots), kv_length=max(lengths) + 1, lora=lora).logits[:, -1]
        for row, row_logits in zip(per_row, logits):
            row.append(row_logits)
        tokens, lengths = logits.argmax(-1).tolist(), [n + 1 for n in lengths]
    return per_row


def test_each_row_gets_its_lone_bits_in_a_batch_of_adapters_and_base(served):
    model, adapters = served
    prompts = [random_ids(model.config, 1, n, seed=n)[0].tolist() for n in LENGTHS]
    adapter_of_row = [BASE, 0, 1, 0, 2]
    batch = run_batch(model, adapters, prompts, adapter_of_row)
    base_only = run_batch(model, adapters, prompts, adapter_of_row, use_lora=False)
    for row, (prompt, index) in enumerate(zip(prompts, adapter_of_row)):
        alone = run_batch(model, adapters, [prompt], [index])[0]
        for step, (got, expected) in enumerate(zip(batch[row], alone)):
            assert torch.equal(got, expected), (row, index, step, float((got - expected).abs().max()))
        if index == BASE:  # untouched by the adapters beside it: today's forward, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(batch[row], base_only[row]))
        else:
            assert not torch.equal(batch[row][0], base_only[row][0])
