"""Resident LoRA adapters and their application inside the forward, rows of many adapters at once.

`LoraSet` holds the adapters a model serves (each its own A and B only, on the model's device and
dtype; never a copy of the base weights), each under a name and a small integer index. Building
one puts a `LoraConv1D` in place of each Conv1D of the blocks (once per model): the layer that
takes a forward's adapters, so model/linear.py knows nothing of them. A forward takes `LoraRows`
(which adapter each batch row uses, -1 for the base), turned once per forward into `LoraGroups`
(the adapted tokens grouped by adapter); every adapted layer then computes the base product for
the whole batch, as without adapters, and adds each adapter's low-rank delta
`scaling * (x @ A.T) @ B.T` to its own rows only, gathered per adapter (as Punica and S-LoRA do).
Base rows never touch new arithmetic, so their output is bit-for-bit that of a forward without
adapters.

A row's delta is computed as a product of that row alone (`SiteDelta`), so it has the same bits
however many rows share its adapter; bench/lora_kernels.py measures the options (docs/lora.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from model.linear import Conv1D
from model.lora_format import SITE_MODULES, AdapterError, LoraAdapter, read_adapter
from model.transfer import to_device

BASE = -1  # a row's adapter index when it uses the base model alone
EXPANDED_COUNTS = 256  # row counts whose expanded A and B each SiteDelta keeps


@dataclass
class SiteDelta:
    """One adapter at one Conv1D, resident: adds rows x [m, in]'s delta to their outputs [m, out].

    Each row is its own [1, in] @ [in, r] and [1, r] @ [r, out] product inside one bmm, over A and
    B expanded (not copied) to the rows: a product of one row has one shape whatever the group's
    size, so a row's delta has the same bits alone and in any batch. A plain [m, in] @ [in, r]
    matmul does not (MKL's kernels change with m), and the oneDNN-packed products the base uses
    cost ~15 us more per call at these sizes (bench/lora_kernels.py, which also measures products
    of fixed tiles of rows: no cheaper once A and B come from memory, and slower with two threads).
    """

    a_t: torch.Tensor  # [in, r]: lora_A transposed
    b_t: torch.Tensor  # [r, out]: lora_B transposed
    scaling: float

    def __post_init__(self) -> None:
        # A and B expanded to m rows ([m, in, r], [m, r, out]: views), made once per row count:
        # a decode step asks for the same few counts at every layer, step after step.
        self._expanded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the delta of x's rows, in place: x [m, 1, in], y [m, 1, out], a row per batch item."""
        m = x.shape[0]
        expanded = self._expanded.get(m)
        if expanded is None:
            expanded = (self.a_t[None].expand(m, -1, -1), self.b_t[None].expand(m, -1, -1))
            # Not in training, which builds its graph through fresh views; and a bounded number
            # (prefill chunks bring many counts).
            if not self.a_t.requires_grad and len(self._expanded) < EXPANDED_COUNTS:
                self._expanded[m] = expanded
        low = torch.bmm(x, expanded[0])  # [m, 1, r]
        # One kernel scales each row's product and adds it to the row: no [m, out] delta is
        # written and read back.
        y.baddbmm_(low, expanded[1], alpha=self.scaling)

    @property
    def nbytes(self) -> int:
        return self.a_t.nbytes + self.b_t.nbytes


def tanh_gelu(y: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, 0.5·y·(1 + tanh(z)) with z = √(2/π)·(y + 0.044715·y³), written as y·σ(2z):
    the same function, and twice as fast on CPU as F.gelu's tanh form (PyTorch's tanh is slow
    there), for the adapted rows that cannot take the GELU fused into their product."""
    two_c = 2.0 * math.sqrt(2.0 / math.pi)
    # σ(2z) in place on one temporary, the operations in the expression's order (the same bits as
    # y * sigmoid((y * y * k + two_c) * y)); the last product out of place, which autograd needs.
    gate = y * y
    gate.mul_(0.044715 * two_c).add_(two_c).mul_(y).sigmoid_()
    return y * gate


class LoraConv1D(nn.Module):
    """A Conv1D of a model serving adapters, in its place (`wrap_layers`): with a forward's
    `LoraGroups` it adds each adapted row's delta to the base product; without, it is the Conv1D."""

    def __init__(self, base: Conv1D, site: str) -> None:
        super().__init__()
        self.base = base
        self.site = site  # the name adapter files use for it, "h.0.attn.c_attn"

    # What the analysis reads of a block's layers (model/attention_bounds.py): the base's.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor:
        return self.base.bias

    def forward(self, x: torch.Tensor, gelu: bool = False, lora: LoraGroups | None = None) -> torch.Tensor:
        if lora is None:
            return self.base(x, gelu)
        return lora.project(self, x, gelu)


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Each adaptable layer of the model's blocks by the name adapter files use for it: a Conv1D,
    or the LoraConv1D standing in its place once `wrap_layers` has run."""
    return {f"h.{index}.{name}": block.get_submodule(name) for index, block in enumerate(model.h) for name in SITE_MODULES}


def wrap_layers(model: nn.Module) -> None:
    """Put a LoraConv1D in place of each Conv1D of the model's blocks; those already wrapped (by
    another LoraSet over the model) stay as they are."""
    for site, layer in adapter_layers(model).items():
        if not isinstance(layer, LoraConv1D):
            owner, _, attribute = site.rpartition(".")
            setattr(model.get_submodule(owner), attribute, LoraConv1D(layer, site))


class LoraSet:
    """The adapters resident for one model, by name and by index (indices of removed adapters are
    reused by later ones). Build it after the model is prepared, moved and quantized. The first
    adapter added puts a LoraConv1D in place of each Conv1D of the blocks: a model that never
    serves one keeps its plain layers."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config
        self.device, self.dtype = model.device, model.dtype
        self._model = model
        # Each adaptable Conv1D by the name an adapter file uses for it, "h.0.attn.c_attn".
        self._site_of: dict[nn.Module, str] = {
            layer.base if isinstance(layer, LoraConv1D) else layer: site for site, layer in adapter_layers(model).items()
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
        wrap_layers(self._model)
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

    def rows(self, adapter_of_row: Sequence[int] | np.ndarray) -> LoraRows | None:
        """What a forward takes for a batch whose row b uses adapter index adapter_of_row[b]
        (BASE: none); None when every row is a base row (the forward is then today's)."""
        adapter_of_row = np.asarray(adapter_of_row, dtype=np.int64).reshape(-1)
        present = np.unique(adapter_of_row).tolist()  # a few indices: array work, no Python per row
        for index in present:
            if index != BASE and (not 0 <= index < len(self._adapters) or self._adapters[index] is None):
                raise KeyError(f"no adapter has index {index}")
        if present == [] or present == [BASE]:
            return None
        return LoraRows(self, adapter_of_row)

    def delta(self, index: int, module: nn.Module) -> SiteDelta | None:
        """Adapter `index`'s delta at a layer (a LoraConv1D or its Conv1D); None where it adapts none."""
        if isinstance(module, LoraConv1D):
            module = module.base
        return self._adapters[index].get(self._site_of.get(module))

    def site_deltas(self, site: str, spans: list[tuple[int, int, int]]) -> list[tuple[int, int, SiteDelta]]:
        """(start, end, delta) of each span (adapter index, start, end) whose adapter adapts `site`."""
        adapters = self._adapters
        return [(start, end, delta) for index, start, end in spans if (delta := adapters[index].get(site)) is not None]

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

    def merged_weight(self, module: nn.Module) -> torch.Tensor:
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
    adapter_of_row: np.ndarray  # [B] int64: each row's adapter index, BASE for none
    # `grouped_by_adapter` of the rows, one token each: found once for both `by_adapter` and a
    # decode forward's `over_width`.
    _rows_grouped: tuple[np.ndarray, list[tuple[int, int, int]]] | None = field(default=None, repr=False, compare=False)

    def by_adapter(self) -> tuple[np.ndarray, np.ndarray, LoraRows] | None:
        """(order, its inverse, the rows in that order): the batch's rows reordered so each
        adapter's are consecutive, as `over_tokens` groups them; None when they already are. A
        forward that runs its rows in this order groups them once (GPT2.forward) instead of
        gathering them at every adapted layer."""
        order, spans = self._grouped_rows()
        if is_identity(order):
            return None
        # Its rows come grouped: in order, each adapter's slice where it was.
        grouped = LoraRows(self.adapters, self.adapter_of_row[order], (np.arange(len(order)), spans))
        return order, inverse_of(order), grouped

    def _grouped_rows(self) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        if self._rows_grouped is None:
            self._rows_grouped = grouped_by_adapter(self.adapter_of_row)
        return self._rows_grouped

    def over_width(self, width: int, device: torch.device) -> LoraGroups:
        """`over_tokens` for `width` tokens a row ([B, T] input ids); a decode step's one token a
        row reuses the rows' grouping (`by_adapter` found it)."""
        if width != 1:
            return self.over_tokens([width] * len(self.adapter_of_row), device)
        order, spans = self._grouped_rows()
        return LoraGroups(self.adapters, order, spans, device)

    def over_tokens(self, tokens_per_row: Sequence[int], device: torch.device) -> LoraGroups:
        """The flattened tokens of each adapter, row b owning the next tokens_per_row[b] of them.
        Built once per forward: every adapted layer of it reads the same groups."""
        if len(tokens_per_row) != len(self.adapter_of_row):
            raise ValueError(f"adapters for {len(self.adapter_of_row)} rows, but the batch has {len(tokens_per_row)}")
        order, spans = grouped_by_adapter(self.adapter_of_row, tokens_per_row)
        return LoraGroups(self.adapters, order, spans, device)


def grouped_by_adapter(adapter_of_row: Sequence[int] | np.ndarray,
                       tokens_per_row: Sequence[int] | None = None) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(order, spans): the flattened tokens (row b owning the next tokens_per_row[b]; one each
    when None) adapter by adapter, adapters as they first appear and the base's last, each
    adapter's tokens in their order; each adapter's (index, start, end) slice of `order`.
    A decode step groups every row of its batch: array operations, no Python per row."""
    shifted = np.asarray(adapter_of_row, dtype=np.int64).reshape(-1) - BASE  # the base 0, adapter i i + 1
    counts = np.bincount(shifted)
    present = np.flatnonzero(counts)  # ascending
    # Each present adapter's first row: the first of its run in a stable sort of the rows.
    by_value = np.argsort(shifted, kind="stable")
    first = by_value[np.cumsum(counts[present]) - counts[present]]
    first[present == 0] = len(shifted)  # the base after every adapter
    by_first = np.argsort(first, kind="stable")  # the adapters in the order they take
    rank = np.zeros(len(counts), dtype=np.int64)
    rank[present[by_first]] = np.arange(len(present))
    places = rank[shifted]  # each row's adapter's place
    if tokens_per_row is not None:  # each token's
        places = np.repeat(places, np.asarray(tokens_per_row, dtype=np.int64))
    order = np.argsort(places, kind="stable")  # stable: each adapter's tokens keep their order
    spans, end = [], 0  # a few adapters: Python's
    for index, size in zip((present[by_first] + BASE).tolist(), np.bincount(places, minlength=len(present)).tolist()):
        end += size
        if index != BASE:
            spans.append((index, end - size, end))
    return order, spans


def is_identity(order: np.ndarray) -> bool:
    return bool((order == np.arange(len(order))).all())


def inverse_of(order: np.ndarray) -> np.ndarray:
    """The permutation that puts `order`'s items back: inverse[order[i]] = i."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse


class LoraGroups:
    """One forward's tokens grouped by adapter: what each adapted layer reads.

    A layer gathers its input's tokens into `order` once, adds every adapter's deltas to the
    contiguous slices `spans` of its output, and puts the output back in place with `inverse`:
    two gathers per layer, whatever the number of adapters, and none when the tokens come grouped
    already (`order` None: a forward of rows in `LoraRows.by_adapter`'s order). Everything a layer
    needs is built here on the host, once per forward: no layer waits on the device to learn its
    indices."""

    def __init__(self, adapters: LoraSet, order: np.ndarray, spans: list[tuple[int, int, int]], device: torch.device) -> None:
        self.adapters = adapters
        self.spans = spans  # (adapter index, start, end): each adapter's slice of `order`
        self.tokens = len(order)
        self._order = order  # the flattened tokens, adapter by adapter, the base's last
        # Layers where only some of the batch's adapters have a delta group those first: one
        # grouping per set of adapters present, shared by every such layer of the forward.
        self._regrouped: dict[tuple[tuple[int, int], ...], tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]] = {}
        self._device = device
        self.order: torch.Tensor | None = None  # None: the tokens are in `order` already
        self.inverse: torch.Tensor | None = None
        if not is_identity(order):
            self.order, self.inverse, _ = self._grouping([(start, end) for _index, start, end in spans])

    def _grouping(self, kept: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """(order, inverse, spans) on the device, with the tokens of the slices `kept` of `_order`
        first, in their order, and the others after."""
        firsts = np.concatenate([np.arange(start, end) for start, end in kept]) if kept else np.zeros(0, np.int64)
        others = np.ones(self.tokens, dtype=bool)
        others[firsts] = False
        order = self._order[np.concatenate([firsts, np.flatnonzero(others)])]
        inverse = inverse_of(order)
        spans, offset = [], 0
        for start, end in kept:
            spans.append((offset, offset + end - start))
            offset += end - start
        order_tensor, inverse_tensor = to_device([order, inverse], self._device)  # one copy
        return order_tensor, inverse_tensor, spans

    def project(self, layer: LoraConv1D, x: torch.Tensor, gelu: bool) -> torch.Tensor:
        """layer.base(x, gelu) with each adapter's delta added to its own tokens (before the GELU)."""
        present = self.adapters.site_deltas(layer.site, self.spans)
        if not present:
            return layer.base(x, gelu)
        order, inverse = self.order, self.inverse
        if len(present) < len(self.spans):  # some adapters of the batch leave this layer alone
            order, inverse, present = self._regroup(present)
        grouped = x.reshape(-1, x.shape[-1])  # [M, in]
        if order is not None:
            grouped = grouped.index_select(0, order)
        adapted = present[-1][1]  # the tokens this layer adapts: grouped[:adapted]
        # Every product is row by row invariant (model/linear.py), so a row's bits are the same
        # in this order as in the batch's.
        if gelu:
            # The delta goes in before the GELU, which the base product fuses: adapted rows take
            # the product unfused, the others keep the fused one (its bits differ from a separate GELU).
            y = layer.base(grouped[:adapted])  # [m, out]
        else:
            y = layer.base(grouped)  # [M, out], every row as without adapters
        x_rows, y_rows = grouped[:, None], y[:, None]  # [M, 1, in], [m or M, 1, out]: a row per product
        for start, end, delta in present:
            delta.add_to(y_rows[start:end], x_rows[start:end])
        if gelu:
            y = tanh_gelu(y)
            if adapted < grouped.shape[0]:
                y = torch.cat([y, layer.base(grouped[adapted:], gelu=True)])
        if inverse is not None:
            y = y.index_select(0, inverse)
        return y.view(*x.shape[:-1], -1)

    def _regroup(self, present: list[tuple[int, int, SiteDelta]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(order, inverse, spans) with the tokens of the adapters in `present` first, the others after."""
        key = tuple((start, end) for start, end, _delta in present)
        if key not in self._regrouped:
            self._regrouped[key] = self._grouping(list(key))
        order, inverse, spans = self._regrouped[key]
        return order, inverse, [(start, end, delta) for (start, end), (_s, _e, delta) in zip(spans, present)]


__all__ = ["AdapterError", "AppliedAdapter", "BASE", "LoraConv1D", "LoraGroups", "LoraRows", "LoraSet", "SiteDelta"]
