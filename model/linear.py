"""GPT-2's linear layers, and the one place that decides which kernel runs a matrix product.

On CPU (float32 and bfloat16) every product runs on oneDNN's inner product with the weight
prepacked once, at load, into oneDNN's blocked layout: the path inductor itself emits for frozen
CPU linears (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`), which also fuses
the MLP's tanh-GELU. bench/kernels.py measures it against PyTorch's default side by side; on the
2-core AMD EPYC this project runs on (one thread, CPU time) a decode step's products took:
- one row (batch-1 decode): MKL `addmm` reads float32 weights at 15-20 GB/s, packed oneDNN at
  27-33 GB/s (a plain read of the same bytes: 35-38 GB/s); in bfloat16, 2.4x faster than
  PyTorch's default bfloat16 path;
- 4-8 rows (beam search, small batches): about the one-row time, 2x faster than unpacked oneDNN
  and MKL;
- 32-128 rows (batched decode, prefill): 1.1-1.3x faster than unpacked oneDNN, which is itself
  1.5-2x faster than MKL here.
The packed copy costs a second copy of the weights in memory (the [in, out] `weight` parameters
stay: the analysis and state_dict read them). Everything else (CUDA, float16, builds without
oneDNN) uses `F.linear`.

int8 (`--quantize int8`, `Int8Weight`): per-output-channel symmetric int8 weights on FBGEMM's
dynamic int8 linear, chosen by bench/kernels_int8.py (docs/performance.md, "int8 weights"): a decode step's
products take 2.4-3.2x fewer milliseconds than packed float32 at one row, 1.5-2.2x at 16-32 rows.
FBGEMM quantizes its input with one scale for the whole matrix; `Int8Weight` gives each row its
own instead (below), so a row's result never depends on the rows beside it.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn


def onednn_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products on this device and dtype run on packed oneDNN weights."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.enabled
        and torch.backends.mkldnn.is_available()
        # Inductor's private ops: a torch build without them falls back to F.linear.
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight_out_in: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a weight [out, in], or None where oneDNN does not serve."""
    if not onednn_serves(weight_out_in.device, weight_out_in.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.detach().contiguous())
    except RuntimeError:
        # oneDNN's bfloat16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on a CPU with
        # neither (AVX2 only) it refuses, and F.linear serves.
        return None


def linear(
    x: torch.Tensor,
    weight_out_in: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | Int8Weight | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """x @ weight_out_in.T + bias, then GPT-2's tanh GELU if asked: [..., in] -> [..., out].

    packed: the same weight from `pack`; used whenever it matches x (same device and dtype).
        Or an `Int8Weight`, which is then always used (it replaces the float weight).
    """
    if isinstance(packed, Int8Weight):
        return packed(x, bias, gelu)
    if packed is not None and x.device.type == "cpu" and x.dtype == packed.dtype:
        post_op, algorithm = ("gelu", "tanh") if gelu else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post_op, [], algorithm)
    y = F.linear(x, weight_out_in, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


class Conv1D(nn.Module):
    """A linear map whose `weight` reads [in, out], as GPT-2 checkpoints store it.

    `prepare` re-lays the storage out as [out, in] (what F.linear and cuBLAS read row by row)
    and keeps `weight` as a transposed view of it, so state_dict names, shapes and values stay
    the checkpoint's; on CPU it also makes the packed oneDNN copy.
    """

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.packed: torch.Tensor | Int8Weight | None = None

    def prepare(self, use_packed: bool = True) -> None:
        weight_out_in = self.weight.detach().t().contiguous()  # [out, in]
        self.weight = nn.Parameter(weight_out_in.t(), requires_grad=False)  # [in, out] view
        self.packed = pack(weight_out_in) if use_packed else None

    def quantize(self) -> None:
        """Serve from int8 weights from now on; the float weight is released (a meta tensor of
        the same shape stays, so the state_dict's names and shapes do, and any use of it fails)."""
        self.packed = Int8Weight(self.weight.t())
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        return linear(x, self.weight.t(), self.bias, self.packed, gelu)


# --- int8 ---------------------------------------------------------------------------------------
QUANTIZE_MODES = ("none", "int8")
QUANTIZE_METHODS = {
    "int8": "int8 weights (symmetric, per output channel) x int8 activations (per row); FBGEMM's dynamic int8 linear",
}
TINY = torch.finfo(torch.float32).tiny


def int8_problem(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why int8 weights cannot serve this device and dtype, in one line; None when they can."""
    if torch.device(device).type != "cpu":
        return f"--quantize int8 runs on the CPU (FBGEMM's int8 linear), not on {torch.device(device).type}"
    if dtype != torch.float32:
        return f"--quantize int8 takes float32 activations (--dtype float32), not {str(dtype).removeprefix('torch.')}"
    if "fbgemm" not in torch.backends.quantized.supported_engines or not hasattr(torch.ops.quantized, "linear_dynamic"):
        return f"--quantize int8 needs FBGEMM, which this torch build ({torch.__version__}) lacks"
    return None


def quantize_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float -> qint8, symmetric per output channel: scale = max |w| of the row / 127."""
    scale = weight.abs().amax(dim=1).clamp_min(TINY) / 127  # [out]
    with warnings.catch_warnings():  # quantized tensors are deprecated; FBGEMM's op still takes them
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(
            weight, scale.double(), torch.zeros(len(weight), dtype=torch.long), 0, torch.qint8
        )


@functools.cache
def full_range_activations() -> bool:
    """Whether FBGEMM multiplies 8-bit activations exactly on this CPU.

    Without VNNI its kernels add pairs of uint8 x int8 products in 16 bits (vpmaddubsw), which
    saturate above 32767, and 255 x 127 x 2 is 64770; PyTorch's answer is reduce_range (7-bit
    activations). With VNNI (vpdpbusd) the sums are 32-bit and 8 bits are exact. Probed with
    exactly that case: 63 inputs at +1 (uint8 255) against weights at +-127.
    """
    weight = torch.ones(2, 64)
    weight[1] = -1.0
    x = torch.ones(1, 64)
    x[0, -1] = -1.0  # the range [-1, 1]: +1 quantizes to 255
    y = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(quantize_per_channel(weight), None), False)
    return bool(torch.allclose(y, x @ weight.t(), atol=1.0))  # exact: +-62; saturated: about +-31


class Int8Weight:
    """A weight [out, in] as symmetric int8 per output channel, prepacked for FBGEMM's dynamic
    int8 linear, which quantizes its float input to uint8 itself.

    FBGEMM picks one affine scale for the whole [M, in] input, from its min and max: a row's
    rounding would depend on the other rows of the batch (a seeded request's tokens on its
    neighbours), and a row that spans a small range would share the coarse steps of one that
    spans a wide one. So each row is mapped affinely onto [-1, 1] first (x = center + half * u),
    and a fixed row [1, -1, 0, ...] is appended: every call sees min -1 and max 1, every row gets
    the same grid whatever the batch, and W x = half * (W u) + center * (W 1) after the integer
    product. Integer sums are exact, so a row's output is bit-identical alone and in any batch.
    Activations get 8 bits where the CPU adds them exactly (`full_range_activations`), else 7.
    """

    def __init__(self, weight_out_in: torch.Tensor) -> None:
        n_out, n_in = weight_out_in.shape
        if n_in < 2:
            raise ValueError(f"an int8 weight needs at least 2 inputs, not {n_in}")
        qweight = quantize_per_channel(weight_out_in.detach().float())
        self.prepacked = torch.ops.quantized.linear_prepack(qweight, None)
        self.shape = (n_out, n_in)
        self.row_sums = qweight.dequantize().sum(dim=1)  # [out]: W 1, of the weights as quantized
        self.bounds = torch.zeros(1, n_in)  # [1, in]: the fixed row [1, -1, 0, ...]
        self.bounds[0, :2] = torch.tensor([1.0, -1.0])
        self.reduce_range = not full_range_activations()

    @property
    def nbytes(self) -> int:
        """Bytes the served weight takes: int8 values plus float32 scales and row sums."""
        return self.shape[0] * self.shape[1] + 8 * self.shape[0]

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] this int8 one stands for."""
        return torch.ops.quantized.linear_unpack(self.prepacked)[0].dequantize()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
        """x [..., in] -> x @ W.T + bias [..., out], then GPT-2's tanh GELU if asked."""
        # Few and in-place ops: at one row each costs about what its arithmetic does.
        rows = x.reshape(-1, self.shape[1])  # [M, in]
        low, high = torch.aminmax(rows, dim=1, keepdim=True)  # [M, 1] each
        center = low.lerp(high, 0.5)  # [M, 1]
        half = high.sub(center).clamp_min_(TINY)  # [M, 1]
        # clamp: (low - center) / half may round one ulp below -1, which would move FBGEMM's grid.
        unit = rows.sub(center).div_(half).clamp_(-1.0, 1.0)  # [M, in]
        out = torch.ops.quantized.linear_dynamic(torch.cat([unit, self.bounds]), self.prepacked, self.reduce_range)
        offset = center * self.row_sums if bias is None else torch.addcmul(bias, center, self.row_sums)  # [M, out]
        y = offset.addcmul_(out[:-1], half).view(*x.shape[:-1], self.shape[0])
        return F.gelu(y, approximate="tanh") if gelu else y
