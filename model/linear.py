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

With `--quantize int8|int4` a `QuantizedWeight` (model/quantized.py) replaces the float weight
and runs the product itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.lone_row import lone_row_agrees
from model.quantized import QuantizedWeight


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
    packed: torch.Tensor | QuantizedWeight | None = None,
    gelu: bool = False,
) -> torch.Tensor:
    """x @ weight_out_in.T + bias, then GPT-2's tanh GELU if asked: [..., in] -> [..., out].

    packed: the same weight from `pack`; used whenever it matches x (same device and dtype).
        Or a `QuantizedWeight`, which is then always used (it replaces the float weight).
    """
    if isinstance(packed, QuantizedWeight):
        return packed(x, bias, gelu)
    if packed is not None and x.device.type == "cpu" and x.dtype == packed.dtype:
        post_op, algorithm = ("gelu", "tanh") if gelu else ("none", "")
        if x.numel() == x.shape[-1] and not lone_row_agrees(packed, bias, weight_out_in.shape, x.dtype, post_op, algorithm):
            # Where oneDNN's kernel for a lone row sums in another order than the batched one
            # (model/lone_row.py probes it), the row runs as two: the batched kernel's bits.
            pair = x.reshape(1, -1).expand(2, -1).contiguous()  # [2, in]
            y = torch.ops.mkldnn._linear_pointwise(pair, packed, bias, post_op, [], algorithm)
            return y[:1].view(*x.shape[:-1], y.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post_op, [], algorithm)
    y = F.linear(x, weight_out_in, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


def released(parameter: nn.Parameter) -> nn.Parameter:
    """A meta stand-in for a float weight a quantized copy replaced: the state_dict keeps its name
    and shape, the memory is freed, and any use of it fails."""
    return nn.Parameter(torch.empty(parameter.shape, device="meta"), requires_grad=False)


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
        self.packed: torch.Tensor | QuantizedWeight | None = None

    def prepare(self, use_packed: bool = True) -> None:
        weight_out_in = self.weight.detach().t().contiguous()  # [out, in]
        self.weight = nn.Parameter(weight_out_in.t(), requires_grad=False)  # [in, out] view
        self.packed = pack(weight_out_in) if use_packed else None

    def quantize(self, make: Callable[[torch.Tensor], QuantizedWeight]) -> None:
        """Serve from quantized weights (make(weight [out, in])) from now on; the float weight is released."""
        self.packed = make(self.weight.t())
        self.weight = released(self.weight)

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        return linear(x, self.weight.t(), self.bias, self.packed, gelu)
