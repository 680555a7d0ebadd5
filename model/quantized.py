"""Quantized weights: what `GPT2.quantize` makes the engine core's products read (`--quantize`).

int8 (`Int8Weight`): per-output-channel symmetric int8 weights on FBGEMM's dynamic int8 linear,
chosen by bench/kernels_int8.py (docs/performance.md, "int8 and int4 weights"): a decode step's
products take 2.4-3.2x fewer milliseconds than packed float32 at one row, 1.5-2.2x at 16-32 rows.
FBGEMM quantizes its input with one scale for the whole matrix; `Int8Weight` gives each row its
own instead (below), so a row's result never depends on the rows beside it.
The first block's products (`PRECISE_BLOCKS`) read their weights in two int8 passes, where
rounding costs the model the most.

int4 (`Int4Weight`): asymmetric int4 per group of 64 inputs on torch's weight-only int4 kernel for
the CPU, with bfloat16 activations: at one row its products run 1.6-2.2x int8's on an AVX-512
host and about int8's on an AVX2-only one (where one served stream still gets 1.2x int8's
tokens/s), slower than int8 from ~16 rows; the least memory. Its model also
looks tokens up in an int8 copy of the embedding (`Int8Rows`), so the float table, a sixth of
GPT-2 124M's served float32 bytes, is released.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.config import GPT2Config
from model.scoring import top_n

QUANTIZE_MODES = ("none", "int8", "int4")
QUANTIZE_METHODS = {
    "int8": "int8 weights (symmetric, per output channel; the first block's in two passes) x int8 activations (per row);"
    " FBGEMM's dynamic int8 linear; each row's 8 best LM-head candidates rescored in float32",
    "int4": "int4 weights (asymmetric, groups of 64 inputs) x bfloat16 activations; torch's _weight_int4pack_mm_for_cpu;"
    " token embedding int8 (symmetric, per row); each row's 8 best LM-head candidates rescored from it",
}
TINY = torch.finfo(torch.float32).tiny
INT4_GROUP = 64  # inputs sharing one scale and zero
INT4_TILE = 16  # the kernel packs output channels 16 at a time: a weight's rows are padded to a multiple
# int8 serves the first blocks' products from two passes of int8 weights (`Int8Weight`), where
# rounding costs the most: on the trained model's held-out text (7-bit weights, AVX2), the first
# block in two passes takes top-1 agreement with float32 from 98.97% to 99.17% and KL from
# 2.9e-4 to 2.3e-4, for ~6% more weight bytes (GPT-2 124M). Kept in float32, the first block
# gained 0.39 points on 40 windows, any other at most 0.1 (docs/performance.md).
PRECISE_BLOCKS = 1
# How many of each row's best LM-head logits `rescore_candidates` recomputes from the embedding rows.
RESCORED_CANDIDATES = 8
# The ops int4 weights need; `int4_problem` refuses a torch build without them.
INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")


def int8_problem(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why int8 weights cannot serve this device and dtype, in one line; None when they can."""
    if torch.device(device).type != "cpu":
        return f"--quantize int8 runs on the CPU (FBGEMM's int8 linear), not on {torch.device(device).type}"
    if dtype != torch.float32:
        return f"--quantize int8 takes float32 activations (--dtype float32), not {str(dtype).removeprefix('torch.')}"
    if "fbgemm" not in torch.backends.quantized.supported_engines or not hasattr(torch.ops.quantized, "linear_dynamic"):
        return f"--quantize int8 needs FBGEMM, which this torch build ({torch.__version__}) lacks"
    return None


def int4_problem(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why int4 weights cannot serve this device and dtype, in one line; None when they can."""
    if torch.device(device).type != "cpu":
        return f"--quantize int4 runs on the CPU (torch's _weight_int4pack_mm_for_cpu), not on {torch.device(device).type}"
    if dtype != torch.float32:
        return (f"--quantize int4 takes float32 activations (--dtype float32; each product reads them in bfloat16),"
                f" not {str(dtype).removeprefix('torch.')}")
    missing = [op for op in INT4_OPS if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"--quantize int4 needs torch's {', '.join(missing)}, which this torch build ({torch.__version__}) lacks"
    return None


def quantize_problem(mode: str, device: torch.device | str, dtype: torch.dtype, config: GPT2Config | None = None) -> str | None:
    """Why `mode` cannot serve this device, dtype (and model, when given), in one line; None when it can."""
    if mode == "none":
        return None
    problem = {"int8": int8_problem, "int4": int4_problem}[mode](device, dtype)
    if problem is None and mode == "int4" and config is not None:
        widths = sorted({w for w in (config.n_embd, config.inner_dim) if w % INT4_GROUP})
        if widths:
            return (f"--quantize int4 groups a product's inputs by {INT4_GROUP}, and this model's products take"
                    f" {' and '.join(map(str, widths))}")
    return problem


class QuantizedWeight:
    """A weight [out, in] a product reads in fewer bits than float32; it replaces the float one."""

    shape: tuple[int, int]  # (out, in)

    @property
    def nbytes(self) -> int:
        """Bytes the served weight takes, every scale included."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this one stands for."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
        """x [..., in] float32 -> x @ W.T + bias [..., out] float32, then GPT-2's tanh GELU if asked."""
        raise NotImplementedError


def gelu_if(y: torch.Tensor, gelu: bool) -> torch.Tensor:
    return F.gelu(y, approximate="tanh") if gelu else y


def rescore_candidates(
    logits: torch.Tensor, head_input: torch.Tensor, embedding_rows: Callable[[torch.Tensor], torch.Tensor],
    count: int = RESCORED_CANDIDATES,
) -> torch.Tensor:
    """A quantized LM head's logits [..., V] with each row's `count` largest recomputed, in place,
    as float32 dot products of head_input [..., C] with the embedding rows of those tokens.

    The head's rounding mostly reshuffles near-ties at the top, which is where greedy decoding,
    top-k and top-p read: recomputed there, the order of the candidates is the float head's
    (on the trained model's held-out text: top-1 agreement with float32 98.48% -> 98.97% for
    int8, 92.1% -> 94.8% for int4; docs/performance.md). It costs a top-k over the vocabulary per row (~0.1 ms)
    and `count` dot products. Each row is computed on its own: batch-independent, like the head.
    """
    # Which of equal logits at the edge get recomputed changes their values: the lowest ids, by
    # a rule, not topk's tie order (which varies with the device and shape).
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, V]
    top = top_n(flat, count)[1].view(*logits.shape[:-1], count)  # [..., count]
    exact = (embedding_rows(top) * head_input.unsqueeze(-2)).sum(-1)  # [..., count]
    return logits.scatter_(-1, top, exact)


# --- int8 ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def quantized_tensors():
    """Making qint8 tensors without torch's deprecation warning: FBGEMM's int8 ops still take them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def quantize_per_channel(weight: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """[out, in] float -> qint8, symmetric per output channel: scale = max |w| of the row / levels."""
    scale = weight.abs().amax(dim=1).clamp_min(TINY) / levels  # [out]
    with quantized_tensors():
        return torch.quantize_per_channel(
            weight, scale.double(), torch.zeros(len(weight), dtype=torch.long), 0, torch.qint8
        )


@functools.cache
def full_range_activations() -> bool:
    """Whether FBGEMM multiplies 8-bit activations exactly on this CPU.

    Without VNNI its kernels add pairs of uint8 x int8 products in 16 bits (vpmaddubsw), which
    saturate above 32767, and 255 x 127 x 2 is 64770 (PyTorch's answer is reduce_range: 7-bit
    activations; ours is 7-bit weights, `weight_levels`). With VNNI (vpdpbusd) the sums are
    32-bit and 8 bits are exact. Probed with
    exactly that case: 63 inputs at +1 (uint8 255) against weights at +-127.
    """
    weight = torch.ones(2, 64)
    weight[1] = -1.0
    x = torch.ones(1, 64)
    x[0, -1] = -1.0  # the range [-1, 1]: +1 quantizes to 255
    y = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(quantize_per_channel(weight), None), False)
    return bool(torch.allclose(y, x @ weight.t(), atol=1.0))  # exact: +-62; saturated: about +-31


def int8_weight_levels() -> int:
    """The int8 weights' grid on this CPU: +-127 where FBGEMM adds 8-bit products exactly, else
    +-63, so that 8-bit activations never saturate its 16-bit pair sums (`Int8Weight`)."""
    return 127 if full_range_activations() else 63


class Int8Weight(QuantizedWeight):
    """A weight [out, in] as symmetric int8 per output channel, prepacked for FBGEMM's dynamic
    int8 linear, which quantizes its float input to uint8 itself.

    FBGEMM picks one affine scale for the whole [M, in] input, from its min and max: a row's
    rounding would depend on the other rows of the batch (a seeded request's tokens on its
    neighbours), and a row that spans a small range would share the coarse steps of one that
    spans a wide one. So each row is mapped affinely onto [-1, 1] first (x = center + half * u),
    and a fixed row [1, -1, 0, ...] is appended: every call sees min -1 and max 1, every row gets
    the same grid whatever the batch, and W x = half * (W u) + center * (W 1) after the integer
    product. Integer sums are exact, so a row's output is bit-identical alone and in any batch.
    Activations always get 8 bits. Weights get 8 (+-127) where the CPU adds pairs of products in
    32 bits (VNNI, `full_range_activations`), else 7 (+-63): 255 x 63 x 2 = 32130 never saturates
    the 16-bit pair sums. On the trained model (AVX2) that is half the KL of PyTorch's answer,
    7-bit activations with 8-bit weights (activation rounding dominates the error:
    docs/performance.md).
    """

    def __init__(self, weight_out_in: torch.Tensor, passes: int = 1) -> None:
        n_out, n_in = weight_out_in.shape
        if n_in < 2:
            raise ValueError(f"an int8 weight needs at least 2 inputs, not {n_in}")
        if passes not in (1, 2):
            raise ValueError(f"an int8 weight takes 1 or 2 passes, not {passes}")
        self.weight_levels = int8_weight_levels()
        weight = weight_out_in.detach().float()
        # passes=2: the second pass is the first's rounding residual on its own per-channel
        # grid, stacked as more output channels of the same product (one call, one input
        # mapping): about twice the bits for twice the weight bytes (`PRECISE_BLOCKS`).
        grids = [quantize_per_channel(weight, self.weight_levels)]
        if passes == 2:
            grids.append(quantize_per_channel(weight - grids[0].dequantize(), self.weight_levels))
        qweight = grids[0] if passes == 1 else stack_per_channel(grids)
        self.prepacked = torch.ops.quantized.linear_prepack(qweight, None)
        self.passes = passes
        self.shape = (n_out, n_in)
        self.row_sums = self.dequantized().sum(dim=1)  # [out]: W 1, of the weights as quantized
        self.bounds = torch.zeros(1, n_in)  # [1, in]: the fixed row [1, -1, 0, ...]
        self.bounds[0, :2] = torch.tensor([1.0, -1.0])

    @property
    def nbytes(self) -> int:
        """int8 values and float32 scales per pass, plus float32 row sums."""
        return self.passes * (self.shape[0] * self.shape[1] + 4 * self.shape[0]) + 4 * self.shape[0]

    def dequantized(self) -> torch.Tensor:
        stacked = torch.ops.quantized.linear_unpack(self.prepacked)[0].dequantize()  # [passes * out, in]
        return stacked.view(self.passes, *self.shape).sum(0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
        # Few and in-place ops: at one row each costs about what its arithmetic does.
        rows = x.reshape(-1, self.shape[1])  # [M, in]
        # Not torch.aminmax: along rows it is ~10x slower than amin and amax (0.35 vs 0.04 ms at 32 x 3072).
        low, high = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)  # [M, 1] each
        center = low.lerp(high, 0.5)  # [M, 1]
        half = high.sub(center).clamp_min_(TINY)  # [M, 1]
        # clamp: (low - center) / half may round one ulp below -1, which would move FBGEMM's grid.
        unit = rows.sub(center).div_(half).clamp_(-1.0, 1.0)  # [M, in]
        out = torch.ops.quantized.linear_dynamic(torch.cat([unit, self.bounds]), self.prepacked, False)
        if self.passes == 2:
            out = out[:, : self.shape[0]].add_(out[:, self.shape[0]:])
        offset = center * self.row_sums if bias is None else torch.addcmul(bias, center, self.row_sums)  # [M, out]
        y = offset.addcmul_(out[:-1], half).view(*x.shape[:-1], self.shape[0])
        return gelu_if(y, gelu)


def stack_per_channel(grids: list[torch.Tensor]) -> torch.Tensor:
    """Per-channel qint8 weights [out_i, in] -> one [sum out_i, in], each channel keeping its scale."""
    scales = torch.cat([g.q_per_channel_scales() for g in grids])
    values = torch.cat([g.int_repr() for g in grids])
    with quantized_tensors():
        return torch._make_per_channel_quantized_tensor(values, scales, torch.zeros(len(scales), dtype=torch.long), 0)


class Int8Rows:
    """An embedding table [V, C] as symmetric int8 per row (scale = max |row| / 127): a lookup
    gathers the int8 rows, then scales them. A quarter of float32's bytes."""

    def __init__(self, table: torch.Tensor) -> None:
        qtable = quantize_per_channel(table.detach().float())
        self.values = qtable.int_repr()  # [V, C] int8
        self.scales = qtable.q_per_channel_scales().float()  # [V]

    @property
    def nbytes(self) -> int:
        return self.values.numel() + 4 * len(self.scales)

    def dequantized(self) -> torch.Tensor:
        """The float32 table [V, C] this one stands for."""
        return self.values.float() * self.scales[:, None]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> their rows [..., C], float32."""
        return self.values[ids].float().mul_(self.scales[ids].unsqueeze(-1))


# --- int4 ---------------------------------------------------------------------------------------
def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> asymmetric int4 per group of `group` inputs, in the kernel's convention
    w = (q - 8) * scale + zero: q [out, in] int32 in [0, 15], scale and zero [out, in / group]
    bfloat16 (the kernel's). Each group's range [min, max] spans 15 steps; scale and zero are
    rounded to bfloat16 before q is, so q rounds to the grid the kernel will use."""
    n_out, n_in = weight.shape
    grouped = weight.view(n_out, n_in // group, group)  # [out, groups, group]
    low, high = grouped.aminmax(dim=-1)  # [out, groups] each
    scale = ((high - low) / 15).clamp_min(TINY).bfloat16()
    zero = (low + 8 * scale.float()).bfloat16()
    q = torch.round((grouped - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    return q.to(torch.int32).view(n_out, n_in), scale, zero


class Int4Weight(QuantizedWeight):
    """A weight [out, in] as asymmetric int4 per group of `group` inputs, packed for torch's
    weight-only int4 product on the CPU (`_weight_int4pack_mm_for_cpu`, tinygemm's layout).

    The kernel multiplies bfloat16 activations (float32 ones run ~12x slower on AVX2, see
    bench/kernels_int8.py): each row is rounded to bfloat16, the products are summed in float32,
    and the result comes back in bfloat16; bias and GELU are then applied in float32. The
    kernel computes each row on its own, so a row's output is bit-identical alone and in any
    batch (tested). Rows are padded to a multiple of 16 (the LM head's 50257 is not one).
    """

    def __init__(self, weight_out_in: torch.Tensor, group: int = INT4_GROUP) -> None:
        n_out, n_in = weight_out_in.shape
        if n_in % group:
            raise ValueError(f"int4 weights group their inputs by {group}: {n_in} inputs is not a multiple of {group}")
        weight = F.pad(weight_out_in.detach().float(), (0, 0, 0, -n_out % INT4_TILE))  # [out padded, in]
        q, scale, zero = int4_groups(weight, group)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)  # [out padded, in / 2] uint8
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in / group, out padded, 2]
        self.group = group
        self.shape = (n_out, n_in)

    @property
    def nbytes(self) -> int:
        """Packed int4 values plus bfloat16 scales and zeros (padding rows included)."""
        return self.packed.nbytes + self.scales_zeros.nbytes

    def dequantized(self) -> torch.Tensor:
        # The kernel on float32 activations dequantizes in float32 exactly; against the identity
        # its output is the weight itself, [in, out].
        identity = torch.eye(self.shape[1])
        weight_t = torch._weight_int4pack_mm_for_cpu(identity, self.packed, self.group, self.scales_zeros.float())
        return weight_t.t()[: self.shape[0]].contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
        n_out, n_in = self.shape
        rows = x.reshape(-1, n_in).bfloat16()  # [M, in]
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_zeros)  # [M, out padded]
        y = y[:, :n_out].float()  # [M, out], a fresh tensor
        if bias is not None:
            y.add_(bias)
        return gelu_if(y.view(*x.shape[:-1], n_out), gelu)


QUANTIZED_WEIGHTS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "int4": Int4Weight}


def block_weights(mode: str, layer_index: int) -> Callable[[torch.Tensor], QuantizedWeight]:
    """What makes the quantized weights of block `layer_index`'s products in `mode`."""
    if mode == "int8" and layer_index < PRECISE_BLOCKS:
        return functools.partial(Int8Weight, passes=2)
    return QUANTIZED_WEIGHTS[mode]
