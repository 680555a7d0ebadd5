"""LoRA adapters in peft's folder format: read (checked against a base model) and written.

A folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors peft names
`base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}.lora_{A|B}.weight`
(`base_model.model.h.{i}...` when the base was a bare GPT2Model). lora_A is [r, in] and lora_B is
[out, r] whatever `fan_in_fan_out` says: peft keeps A and B as nn.Linear weights and applies the
flag only when merging into GPT-2's [in, out] Conv1D weight (it forces the flag on for Conv1D).

Anything that would make our forward compute something else than peft's is refused with one
line naming the option or the tensor (`AdapterError`): a bad adapter must never serve.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model.config import GPT2Config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
# The Conv1D modules of a GPT-2 block an adapter may target, by their name inside the block.
SITE_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_TENSOR_KEY = re.compile(
    r"^base_model\.model\.(?P<module>(?:transformer\.)?h\.(?P<layer>\d+)\.(?P<site>attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj))"
    r"\.lora_(?P<half>[AB])\.weight$"
)
# Options read here, each checked or applied below.
_APPLIED = {
    "peft_type", "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "use_dora", "bias",
    "init_lora_weights",
}
# Options that only shape training or bookkeeping: the trained tensors mean the same without them.
_NO_EFFECT_ON_INFERENCE = {
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "lora_dropout", "auto_mapping",
    "peft_version", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config",
    "megatron_core", "qalora_group_size", "ensure_weight_tying",
}
# init_lora_weights values under which peft also rewrites the base weights: the adapter then
# only means something on that rewritten base, which we do not have.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


class AdapterError(ValueError):
    """An adapter folder this model cannot serve; the message is one line saying why."""


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


def _truthy(value) -> bool:
    return value not in (None, False, "", [], {}, "none")


def _check_options(config: dict, where: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config['peft_type']!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: use_dora=true (DoRA) is not supported; only plain LoRA adapters are")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={config['bias']!r} is not supported (the adapter would change the base's biases); only \"none\"")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(f"{where}: init_lora_weights={init!r} rewrites the base weights, which this model does not have")
    for key, value in sorted(config.items()):
        if key not in _APPLIED and key not in _NO_EFFECT_ON_INFERENCE and _truthy(value):
            raise AdapterError(f"{where}: option {key}={json.dumps(value)} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    pattern = config.get("layers_pattern")
    if _truthy(pattern) and pattern not in ("h", ["h"]):
        raise AdapterError(f"{where}: layers_pattern={pattern!r} names no GPT-2 layer list (GPT-2's is \"h\")")


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key matching the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _targeted(config: dict, module: str, layer: int) -> bool:
    """Whether peft would have put a LoRA layer on `module` (its full name), as peft decides."""
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str) and re.fullmatch(excluded, module):
        return False
    if isinstance(excluded, list) and any(module == e or module.endswith(f".{e}") for e in excluded):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    if not any(module == t or module.endswith(f".{t}") for t in targets or ()):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    return layer in ([layers] if isinstance(layers, int) else layers)


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{folder}: no {CONFIG_FILE} (not a peft adapter folder)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    _check_options(config, path)
    return config


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        if (folder / PICKLE_FILE).exists():
            raise AdapterError(f"{folder}: only {WEIGHTS_FILE} is read, not {PICKLE_FILE} (a pickle, which can run code on load)")
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from None


def read_adapter(folder: str | Path, base: GPT2Config) -> LoraAdapter:
    """The adapter in `folder`, checked against a base of config `base` (AdapterError if not servable)."""
    folder = Path(folder)
    config = read_config(folder)
    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    shapes = site_shapes(base)
    for key, tensor in read_tensors(folder).items():
        match = _TENSOR_KEY.match(key)
        if match is None:
            raise AdapterError(f"tensor {key}: {_unknown_key_reason(key)}")
        layer, site, module = int(match["layer"]), match["site"], match["module"]
        if layer >= base.n_layer:
            raise AdapterError(f"tensor {key}: layer {layer}, but the base has {base.n_layer} layers")
        if not _targeted(config, module, layer):
            raise AdapterError(f"tensor {key}: {module} is not among the adapter's target_modules/layers_to_transform")
        if not tensor.is_floating_point():
            raise AdapterError(f"tensor {key}: dtype {tensor.dtype} is not floating point")
        halves.setdefault(f"h.{layer}.{site}", {})[match["half"]] = (key, tensor)
    if not halves:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: holds no LoRA tensors")
    sites = {}
    for name, pair in sorted(halves.items()):
        site = name.split(".", 2)[2]
        sites[name] = _site_weights(config, name, site, pair, shapes[site])
    return LoraAdapter(sites=sites, config=config)


def _unknown_key_reason(key: str) -> str:
    if "lora_embedding" in key or re.search(r"\.(wte|wpe|lm_head)\.", key):
        return "adapts an embedding or the LM head; only c_attn, c_proj and c_fc can be adapted"
    if "lora_magnitude_vector" in key:
        return "a DoRA magnitude; DoRA is not supported"
    if key.endswith(".bias"):
        return "a LoRA bias; only bias-free adapters are supported"
    return "not a LoRA tensor of a GPT-2 block's c_attn, c_proj or c_fc"


def _site_weights(config: dict, name: str, site: str, pair: dict, shape: tuple[int, int]) -> SiteWeights:
    n_in, n_out = shape
    for half, other in (("A", "B"), ("B", "A")):
        if half not in pair:
            raise AdapterError(f"tensor {pair[other][0]}: its lora_{half} partner is missing")
    (key_a, a), (key_b, b) = pair["A"], pair["B"]
    module = f"transformer.{name}"
    rank = _pattern_value(config.get("rank_pattern"), module, config["r"])
    if a.dim() != 2 or a.shape[1] != n_in:
        raise AdapterError(f"tensor {key_a}: shape {tuple(a.shape)}, the base's {site} takes {n_in} inputs (expected [r, {n_in}])")
    if b.dim() != 2 or b.shape[0] != n_out:
        raise AdapterError(f"tensor {key_b}: shape {tuple(b.shape)}, the base's {site} gives {n_out} outputs (expected [{n_out}, r])")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"tensors {key_a} {tuple(a.shape)} and {key_b} {tuple(b.shape)} do not have the config's rank {rank}")
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return SiteWeights(a=a, b=b, scaling=scaling)


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
