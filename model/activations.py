"""The MLP activations a GPT-2 config may name (`activation_function`), each the function
transformers' ACT2FN gives that name, written with the same formula and constants.

GPT-2 itself uses `gelu_new`, GELU's tanh approximation; Cerebras-GPT uses `gelu` (the exact,
erf one); rinna's Japanese GPT-2 models use `gelu_fast`. The tanh approximation runs fused into
the MLP's first product where the kernel offers it (model/linear.py); the others run after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]

# Names meaning GELU's tanh approximation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): one function
# whichever formula transformers writes it with, so each runs as the fused product's GELU.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate")

def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    # transformers' constant, rounded to 10 digits as it writes it: not exactly √(2/π).
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def clipped_gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.clip(F.gelu(x), -10.0, 10.0)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


def laplace(x: torch.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - mu).div(sigma * math.sqrt(2.0))))


ACTIVATIONS: dict[str, Activation] = {
    **dict.fromkeys(TANH_GELU, tanh_gelu),
    "gelu": F.gelu,
    "gelu_python": erf_gelu,
    "gelu_10": clipped_gelu,
    "gelu_fast": fast_gelu,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "relu2": relu_squared,
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,  # nn.LeakyReLU's default slope, 0.01
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "linear": identity,
    "laplace": laplace,
    "sqrtsoftplus": sqrt_softplus,
}

# Names ACT2FN knows whose functions hold learned parameters (a slope, xIELU's alphas) that no
# GPT-2 checkpoint stores under a name this loader reads: refused, not computed with made-up values.
LEARNED_ACTIVATIONS = ("prelu", "xielu")


def activation_problem(name: object) -> str | None:
    """Why `name` cannot be served as `activation_function`, in one line; None when it can."""
    if name in ACTIVATIONS:
        return None
    if name in LEARNED_ACTIVATIONS:
        return f"unsupported activation_function {name!r}: it has learned parameters GPT-2 checkpoints do not hold"
    return f"unsupported activation_function {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
