"""Resident LoRA adapters and their application inside the forward, rows of many adapters at once.

`LoraSet` holds the adapters a model serves (each its own A and B only, on the model's device and
dtype; never a copy of the base weights), each under a name and a small integer index. A forward
takes `LoraRows` (which adapter each batch row uses, -1 for the base): every adapted Conv1D then
computes the base product once for the whole batch, as without adapters, and adds each
adapter's low-rank delta `scaling * (x @ A.T) @ B.T` to its own rows only, gathered per adapter
(as Punica and S-LoRA do). Base rows never touch new arithmetic, so their output is bit-for-bit
that of a forward without adapters.

A row's delta is computed as a product of that row alone (`SiteDelta`), so it has the same bits
however many rows share its adapter; bench/lora_kernels.py measures the options (docs/lora.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.linear import Conv1D
from model.transfer import to_device
from model.lora_format import AdapterError, LoraAdapter, read_adapter

BASE = -1  # a row's adapter index when it uses the base model alone


@dataclass
class SiteDelta:
    """One adapter at one Conv1D, resident: rows x [m, in] -> their delta [m, out].

    Each row is its own [1, in] @ [in, r] and [1, r] @ [r, out] product inside one bmm, over A and
    B expanded (not copied) to the rows: a product of one row has one shape whatever the group's
    size, so a row's delta has the same bits alone and in any batch. A plain [m, in] @ [in, r]
    matmul does not (MKL's kernels change with m), and the oneDNN-packed products the base uses
    cost ~15 us more per call at these sizes (bench/lora_kernels.py).
    """

    a_t: torch.Tensor  # [in, r]: lora_A transposed
    b_t: torch.Tensor  # [r, out]: lora_B transposed
    scaling: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = len(x)
        low = torch.bmm(x[:, None], self.a_t[None].expand(m, -1, -1))  # [m, 1, r]
        # Scaling the [m, r] intermediate costs r multiplies per row, not out.
        return torch.bmm(low * self.scaling, self.b_t[None].expand(m, -1, -1))[:, 0]  # [m, out]

    @property
    def nbytes(self) -> int:
        return self.a_t.nbytes + self.b_t.nbytes


class LoraSet:
    """The adapters resident for one model, by name and by index (indices of removed adapters are
    reused by later ones). Build it after the model is prepared, moved and quantized."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config
        self.device, self.dtype = model.device, model.dtype
        # Each adaptable Conv1D by the name an adapter file uses for it, "h.0.attn.c_attn".
        self._site_of: dict[nn.Module, str] = {
            module: f"h.{name}" for name, module in model.h.named_modules() if isinstance(module, Conv1D)
        }
        self._adapters: list[dict[str, SiteDelta] | None] = []
        self._index_of: dict[str, int] = {}

    def load(self, name: str, folder: str | Path) -> int:
        """Read, check and add the peft folder; its index. AdapterError names what is wrong."""
        return self.add(name, read_adapter(folder, self.config))

    def add(self, name: str, adapter: LoraAdapter) -> int:
        """Make `adapter` resident under `name`; its index. Tensors that require grad are kept as
        they are (training), others are copied to the model's device and dtype."""
        if name in self._index_of:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        unknown = sorted(set(adapter.sites) - set(self._site_of.values()))
        if unknown:
            raise AdapterError(f"adapter {name!r} adapts {unknown[0]}, which this model does not have")
        # Every tensor is made resident and checked before the name is taken: a refusal changes nothing.
        deltas = {site: self._resident(name, site, w.a, w.b, w.scaling) for site, w in adapter.sites.items()}
        index = self._adapters.index(None) if None in self._adapters else len(self._adapters)
        if index == len(self._adapters):
            self._adapters.append(None)
        self._adapters[index] = deltas
        self._index_of[name] = index
        return index

    def _resident(self, name: str, site: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> SiteDelta:
        if a.requires_grad or b.requires_grad:
            return SiteDelta(a.t(), b.t(), scaling)  # views: gradients reach the trained tensors
        # Finite as read (model/lora_format.py), but a value or a scaling past the model dtype's
        # range would become inf in it, and NaN in every logit of the adapter's rows.
        if not abs(scaling) <= torch.finfo(self.dtype).max:
            raise AdapterError(f"adapter {name!r}: {site}'s scaling {scaling:g} (lora_alpha / r) overflows {self.dtype}")
        resident = SiteDelta(a.t().to(self.device, self.dtype).contiguous(), b.t().to(self.device, self.dtype).contiguous(), scaling)
        for half, tensor in (("lora_A", resident.a_t), ("lora_B", resident.b_t)):
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterError(f"adapter {name!r}: {site}'s {half} holds values past {self.dtype}'s range")
        return resident

    def remove(self, name: str) -> None:
        """Free the adapter's tensors; its index may be given to the next adapter added, so the
        caller must have no row still using it."""
        self._adapters[self.index(name)] = None
        del self._index_of[name]

    def index(self, name: str) -> int:
        if name not in self._index_of:
            raise KeyError(f"no adapter named {name!r} is loaded")
        return self._index_of[name]

    @property
    def names(self) -> list[str]:
        return list(self._index_of)

    def __contains__(self, name: str) -> bool:
        return name in self._index_of

    def nbytes(self, name: str) -> int:
        """Bytes the adapter's resident tensors take: its A and B, nothing of the base."""
        return sum(d.nbytes for d in self._adapters[self.index(name)].values())

    def rows(self, adapter_of_row: Sequence[int]) -> LoraRows | None:
        """What a forward takes for a batch whose row b uses adapter index adapter_of_row[b]
        (BASE: none); None when every row is a base row (the forward is then today's)."""
        adapter_of_row = [int(i) for i in adapter_of_row]
        for index in set(adapter_of_row) - {BASE}:
            if not 0 <= index < len(self._adapters) or self._adapters[index] is None:
                raise KeyError(f"no adapter has index {index}")
        if all(i == BASE for i in adapter_of_row):
            return None
        return LoraRows(self, adapter_of_row)

    def delta(self, index: int, module: nn.Module) -> SiteDelta | None:
        return self._adapters[index].get(self._site_of.get(module))

    def applied(self, name: str) -> AppliedAdapter:
        """The adapter as one model to analyse: every row of a forward uses it."""
        return AppliedAdapter(self, name, self.index(name))


@dataclass(frozen=True, eq=False)  # hashed by identity: caches keyed on it go with it
class AppliedAdapter:
    """One resident adapter applied to the whole model, as an analysis of the fine-tune reads it."""

    adapters: LoraSet
    name: str
    index: int

    def rows(self, batch_size: int) -> LoraRows:
        return self.adapters.rows([self.index] * batch_size)

    def merged_weight(self, module: Conv1D) -> torch.Tensor:
        """The Conv1D's weight [in, out] with the delta merged, W + scaling·(B A)ᵀ: what peft's
        merge_and_unload leaves in GPT-2's Conv1D (fan_in_fan_out). The weight itself if not adapted."""
        delta = self.adapters.delta(self.index, module)
        if delta is None:
            return module.weight
        return module.weight + delta.scaling * (delta.a_t @ delta.b_t)


@dataclass
class LoraRows:
    """Which adapter each row of a batch uses (`LoraSet.rows`); passed to GPT2.forward / forward_packed."""

    adapters: LoraSet
    adapter_of_row: list[int]

    def over_tokens(self, tokens_per_row: Sequence[int], device: torch.device) -> LoraGroups:
        """The flattened tokens of each adapter, row b owning the next tokens_per_row[b] of them."""
        if len(tokens_per_row) != len(self.adapter_of_row):
            raise ValueError(f"adapters for {len(self.adapter_of_row)} rows, but the batch has {len(tokens_per_row)}")
        positions: dict[int, list[int]] = {}
        start = 0
        for index, count in zip(self.adapter_of_row, tokens_per_row):
            if index != BASE:
                positions.setdefault(index, []).extend(range(start, start + count))
            start += count
        groups = [(index, to_device(rows, device)) for index, rows in sorted(positions.items())]
        return LoraGroups(self.adapters, groups)


@dataclass
class LoraGroups:
    """One forward's tokens grouped by adapter: what each adapted Conv1D reads."""

    adapters: LoraSet
    groups: list[tuple[int, torch.Tensor]]  # (adapter index, [m] positions in the flattened tokens)

    def project(self, module: Conv1D, x: torch.Tensor, gelu: bool) -> torch.Tensor:
        """module(x, gelu) with each adapter's delta added to its own tokens (before the GELU)."""
        deltas = [(rows, d) for index, rows in self.groups if (d := self.adapters.delta(index, module)) is not None]
        if not deltas:
            return module(x, gelu)
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        if not gelu:
            y = module(flat)  # [M, out], every row as without adapters
            for rows, delta in deltas:
                y.index_add_(0, rows, delta(flat.index_select(0, rows)))
            return y.view(*x.shape[:-1], -1)
        return self._project_gelu(module, flat, deltas).view(*x.shape[:-1], -1)

    @staticmethod
    def _project_gelu(module: Conv1D, flat: torch.Tensor, deltas: list) -> torch.Tensor:
        # The delta goes in before the GELU, which the base product fuses: adapted rows take the
        # product unfused, the others keep the fused one (its bits differ from a separate GELU).
        adapted = torch.cat([rows for rows, _ in deltas])  # [m]
        pre = module(flat.index_select(0, adapted))  # [m, out]
        parts, start = [], 0
        for rows, delta in deltas:
            parts.append(pre[start : start + len(rows)] + delta(flat.index_select(0, rows)))
            start += len(rows)
        activated = F.gelu(torch.cat(parts), approximate="tanh")  # [m, out]
        others = torch.ones(len(flat), dtype=torch.bool, device=flat.device)
        others[adapted] = False
        base_rows = others.nonzero()[:, 0]
        y = flat.new_empty(len(flat), activated.shape[-1])
        if len(base_rows):
            y[base_rows] = module(flat.index_select(0, base_rows), gelu=True)
        return y.index_copy(0, adapted, activated)


__all__ = ["AdapterError", "AppliedAdapter", "BASE", "LoraGroups", "LoraRows", "LoraSet", "SiteDelta"]
