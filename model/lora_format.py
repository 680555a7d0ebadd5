"""LoRA adapters in peft's folder format: read (checked against a base model) and written.

A folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors peft names
`base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}.lora_{A|B}.weight`
(`base_model.model.h.{i}...` when the base was a bare GPT2Model). lora_A is [r, in] and lora_B is
[out, r] whatever `fan_in_fan_out` says: peft keeps A and B as nn.Linear weights and applies the
flag only when merging into GPT-2's [in, out] Conv1D weight (it forces the flag on for Conv1D).

Anything that would make our forward compute something else than peft's is refused with one
line naming the option or the tensor (`AdapterError`): a bad adapter must never serve. The
config is read as data by model/lora_config.py; here the tensors are checked against it and
against the base: names, shapes, ranks, and values (a NaN or inf would reach every logit of a
request using the adapter).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.config import GPT2Config
from model.lora_config import CONFIG_FILE, AdapterError, LoraOptions, one_line, read_config

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
# The Conv1D modules of a GPT-2 block an adapter may target, by their name inside the block.
SITE_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_TENSOR_KEY = re.compile(
    r"^base_model\.model\.(?P<module>(?:transformer\.)?h\.(?P<layer>\d+)\.(?P<site>attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj))"
    r"\.lora_(?P<half>[AB])\.weight$"
)
@dataclass
class SiteWeights:
    """One adapted Conv1D: its delta is scaling * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass
class LoraAdapter:
    sites: dict[str, SiteWeights]  # by block-relative module name, "h.0.attn.c_attn"
    config: dict  # adapter_config.json as read

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.sites.values())


def site_shapes(config: GPT2Config) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable module of a block."""
    C, inner = config.n_embd, config.inner_dim
    return {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, inner), "mlp.c_proj": (inner, C)}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():  # the folder's name was checked by read_config
        if (folder / PICKLE_FILE).exists():
            raise AdapterError(f"{one_line(folder)}: only {WEIGHTS_FILE} is read, not {PICKLE_FILE} (a pickle, which can run code on load)")
        raise AdapterError(f"{one_line(folder)}: no {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{one_line(path)}: not a readable safetensors file ({one_line(exc)})") from None


def read_adapter(folder: str | Path, base: GPT2Config) -> LoraAdapter:
    """The adapter in `folder`, checked against a base of config `base` (AdapterError if not servable)."""
    folder = Path(folder)
    options = read_config(folder)
    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    shapes = site_shapes(base)
    for key, tensor in read_tensors(folder).items():
        match = _TENSOR_KEY.match(key)
        if match is None:
            raise AdapterError(f"tensor {one_line(key)}: {_unknown_key_reason(key)}")
        layer, site, module = int(match["layer"]), match["site"], match["module"]
        if layer >= base.n_layer:
            raise AdapterError(f"tensor {key}: layer {layer}, but the base has {base.n_layer} layers")
        if not options.targeted(module, layer):
            raise AdapterError(f"tensor {key}: {module} is not among the adapter's target_modules/layers_to_transform")
        if not tensor.is_floating_point():
            raise AdapterError(f"tensor {key}: dtype {tensor.dtype} is not floating point")
        if not _finite(tensor):
            raise AdapterError(f"tensor {key}: holds non-finite values (NaN or inf)")
        halves.setdefault(f"h.{layer}.{site}", {})[match["half"]] = (key, tensor)
    if not halves:
        raise AdapterError(f"{one_line(folder / WEIGHTS_FILE)}: holds no LoRA tensors")
    sites = {}
    for name, pair in sorted(halves.items()):
        site = name.split(".", 2)[2]
        sites[name] = _site_weights(options, name, site, pair, shapes[site])
    return LoraAdapter(sites=sites, config=options.raw)


def _finite(tensor: torch.Tensor) -> bool:
    # isfinite has no kernel for some one-byte floats (float8_e4m3fn); their float32 copy is small.
    return bool(torch.isfinite(tensor if tensor.dtype.itemsize > 1 else tensor.float()).all())


def _unknown_key_reason(key: str) -> str:
    if "lora_embedding" in key or re.search(r"\.(wte|wpe|lm_head)\.", key):
        return "adapts an embedding or the LM head; only c_attn, c_proj and c_fc can be adapted"
    if "lora_magnitude_vector" in key:
        return "a DoRA magnitude; DoRA is not supported"
    if key.endswith(".bias"):
        return "a LoRA bias; only bias-free adapters are supported"
    return "not a LoRA tensor of a GPT-2 block's c_attn, c_proj or c_fc"


def _site_weights(options: LoraOptions, name: str, site: str, pair: dict, shape: tuple[int, int]) -> SiteWeights:
    n_in, n_out = shape
    for half, other in (("A", "B"), ("B", "A")):
        if half not in pair:
            raise AdapterError(f"tensor {pair[other][0]}: its lora_{half} partner is missing")
    (key_a, a), (key_b, b) = pair["A"], pair["B"]
    module = f"transformer.{name}"
    rank = options.rank(module)
    if rank > min(n_in, n_out):  # past the width a product of rank r adds nothing: a config for another model
        raise AdapterError(f"{name}: rank {rank} (r or rank_pattern) exceeds the base's {site} width "
                           f"min({n_in}, {n_out}); a LoRA's rank is at most that")
    if a.dim() != 2 or a.shape[1] != n_in:
        raise AdapterError(f"tensor {key_a}: shape {tuple(a.shape)}, the base's {site} takes {n_in} inputs (expected [r, {n_in}])")
    if b.dim() != 2 or b.shape[0] != n_out:
        raise AdapterError(f"tensor {key_b}: shape {tuple(b.shape)}, the base's {site} gives {n_out} outputs (expected [{n_out}, r])")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"tensors {key_a} {tuple(a.shape)} and {key_b} {tuple(b.shape)} do not have the config's rank {rank}")
    # Finite: alpha is a finite number and rank at least 1; whether it fits the model's dtype is LoraSet's check.
    return SiteWeights(a=a, b=b, scaling=options.scaling(module))


def adapter_config(rank: int, alpha: float, target_modules: list[str], base_model: str = "", **extra) -> dict:
    """An adapter_config.json as peft writes it for GPT-2 (the keys that matter to a reader)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "revision": None,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(target_modules),
        "exclude_modules": None, "fan_in_fan_out": True, "bias": "none", "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True, **extra,
    }


def write_adapter(folder: str | Path, sites: dict[str, tuple[torch.Tensor, torch.Tensor]], config: dict) -> Path:
    """peft's folder: `sites` maps "h.0.attn.c_attn" to (A [r, in], B [out, r])."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in sites.items():
        tensors[f"{PEFT_PREFIX}transformer.{name}.lora_A.weight"] = a.detach().float().contiguous()
        tensors[f"{PEFT_PREFIX}transformer.{name}.lora_B.weight"] = b.detach().float().contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder
