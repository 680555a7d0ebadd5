"""GPT-2's linear layers, and the one place that decides which kernel runs a matrix product.

On CPU, PyTorch sends float32 `addmm`/`F.linear` to MKL, whose kernels on this AMD machine read
the weights at about half the memory bandwidth for one row (decode) and run 2-2.5x slower than
oneDNN at 8-128 rows (batched decode, prefill); bench/kernels.py measures both side by side.
oneDNN's inner product (the op inductor itself emits for frozen CPU linears) is reached through
`torch.ops.mkldnn._linear_pointwise`, which also fuses the tanh-GELU into the MLP's first
product. Everything else (CUDA, float16, builds without oneDNN) uses `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's CPU inner product is the faster kernel for this device and dtype."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.enabled
        and torch.backends.mkldnn.is_available()
    )


def linear(
    x: torch.Tensor,
    weight_out_in: torch.Tensor,
    bias: torch.Tensor | None,
    onednn: bool,
    gelu: bool = False,
) -> torch.Tensor:
    """x @ weight_out_in.T + bias, then GPT-2's tanh GELU if asked: [..., in] -> [..., out]."""
    if onednn and x.device.type == "cpu":
        if gelu:
            return torch.ops.mkldnn._linear_pointwise(x, weight_out_in, bias, "gelu", [], "tanh")
        return torch.ops.mkldnn._linear_pointwise(x, weight_out_in, bias, "none", [], "")
    y = F.linear(x, weight_out_in, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


class Conv1D(nn.Module):
    """A linear map whose `weight` reads [in, out], as GPT-2 checkpoints store it.

    `prepare` re-lays the storage out as [out, in] (what F.linear, cuBLAS and oneDNN stream
    row by row) and keeps `weight` as a transposed view of it, so state_dict names, shapes and
    values stay the checkpoint's and no second copy of the weights is kept.
    """

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.onednn = False

    def prepare(self, onednn: bool) -> None:
        weight_out_in = self.weight.detach().t().contiguous()  # [out, in]
        self.weight = nn.Parameter(weight_out_in.t(), requires_grad=False)  # [in, out] view
        self.onednn = onednn

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        return linear(x, self.weight.t(), self.bias, self.onednn, gelu=gelu)
