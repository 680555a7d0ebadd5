"""Which kernel reads GPT-2's weights fastest: the matrix products of one decode step, side by side.

    .venv/bin/python -m bench.kernels --threads 1 --rows 1 8 32

For each batch size (rows of x) it times every GPT-2 124M block matrix plus the LM head with:
`addmm` on the checkpoint's [in, out] layout (PyTorch's default, as transformers runs it; MKL
on CPU), `F.linear` on [out, in], oneDNN's inner product on the plain [out, in] weight and on
the packed one (model/linear.py), and, as the ceiling, a plain read of the same bytes (`sum`).
Effective GB/s = weight bytes / time. Times are CPU seconds of this process
(time.process_time), interleaved, best of --reps.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.common import DTYPES, add_smoke_argument, interleaved
from model.linear import linear, pack


@dataclass(frozen=True)
class Shapes:
    """The matrices of one decode step: `layers` copies of each block matrix, then the tied LM head."""

    width: int
    layers: int
    vocab: int

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """(in, out) of c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj."""
        w = self.width
        return [(w, 3 * w), (w, w), (w, 4 * w), (4 * w, w)]

    @property
    def products(self) -> int:
        return len(self.blocks) * self.layers + 1


GPT2_124M = Shapes(width=768, layers=12, vocab=50257)
# --smoke: int4's packed kernels need the widths in multiples of 64 (their groups).
SMOKE = Shapes(width=128, layers=2, vocab=1024)


def parse_shapes(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Shapes]:
    """The command line (its --threads applied) and the matrices to time: GPT-2 124M's, or with
    --smoke tiny ones, once."""
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.reps = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    return args, SMOKE if args.smoke else GPT2_124M


def kernels(x: torch.Tensor, w_in_out: torch.Tensor, w_out_in: torch.Tensor, bias: torch.Tensor | None):
    packed = pack(w_out_in)
    return {
        "addmm [in,out]": lambda: torch.addmm(bias, x, w_in_out) if bias is not None else x @ w_in_out,
        "F.linear [out,in]": lambda: F.linear(x, w_out_in, bias),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w_out_in, bias, "none", [], ""),
        "onednn packed": lambda: linear(x, w_out_in, bias, packed),
        "read (sum)": lambda: w_out_in.sum(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=5)
    args, shapes = parse_shapes(parser)
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(0)

    def weights(n_in: int, n_out: int, copies: int):
        out_in = [torch.randn(n_out, n_in, generator=generator).to(dtype) * 0.02 for _ in range(copies)]
        return [w.t().contiguous() for w in out_in], out_in  # [in, out], [out, in]

    # Distinct matrices per layer, as in the model: nothing stays in cache between products.
    groups = {f"blocks {i}x{o}": (weights(i, o, shapes.layers), torch.zeros(o, dtype=dtype)) for i, o in shapes.blocks}
    groups[f"lm head {shapes.width}x{shapes.vocab}"] = (weights(shapes.width, shapes.vocab, 1), None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; best CPU ms per"
          " step (GB/s)")
    for rows in args.rows:
        totals: dict[str, float] = {}
        for name, ((in_out, out_in), bias) in groups.items():
            x = torch.randn(rows, in_out[0].shape[0], generator=generator).to(dtype)  # [rows, in]
            per_layer = [kernels(x, a, b, bias) for a, b in zip(in_out, out_in)]
            runs = {k: (lambda k=k: [p[k]() for p in per_layer]) for k in per_layer[0]}
            best = {k: min(v) for k, v in interleaved(runs, args.reps, clock=time.process_time).items()}
            nbytes = sum(w.numel() * w.element_size() for w in out_in)
            cells = "  ".join(f"{k} {s * 1e3:6.2f} ({nbytes / s / 1e9:4.1f})" for k, s in best.items())
            print(f"rows={rows:3d} {name:18s} {cells}")
            for k, s in best.items():
                totals[k] = totals.get(k, 0.0) + s
        print(f"rows={rows:3d} {'one decode step':18s} " + "  ".join(f"{k} {s * 1e3:6.2f}" for k, s in totals.items()))


if __name__ == "__main__":
    main()
