"""Which int8 or int4 kernel runs a decode step's matrix products fastest on this CPU, beside float32.

    .venv/bin/python -m bench.kernels_int8                      # 1, 16 and 32 rows, torch's threads
    .venv/bin/python -m bench.kernels_int8 --threads 1 --clock cpu --rows 1 32

As bench/kernels.py: every GPT-2 124M block matrix (12 distinct copies of each shape, so nothing
stays in cache between products) plus the tied LM head, for x of --rows rows, float32 in and
float32 out, every conversion the kernel needs counted. Kernels:
- fp32 oneDNN packed: the float path served today (model/linear.py); fp32 F.linear (MKL);
- FBGEMM int8, per-tensor activations: `quantized.linear_dynamic` as PyTorch's dynamic
  quantization runs it (int8 weights per output channel, 7-bit activations, one scale per call);
- FBGEMM int8, per-row activations: the same op as served (`model.linear.Int8Weight`: each row
  its own range, 8 bits where the CPU adds them exactly, results independent of the batch);
- `_int_mm` int8: activations quantized per row in PyTorch, oneDNN's s8 x s8 -> s32 product;
- `_weight_int8pack_mm` (int8 weights only) with float32 or bfloat16 activations;
- int4, groups of 64: `_weight_int4pack_mm_for_cpu` with bfloat16 activations (as served:
  `model.quantized.Int4Weight`) and with float32 ones, and `_dyn_quant_matmul_4bit` (groups of
  32, activations quantized inside; KleidiAI on Arm).
A kernel slower than 8x float32 at one row count is skipped at the larger ones. Also printed:
each kernel's relative error against the float32 product, on the first matrix of each shape.
Times are the best of --reps, interleaved (bench.common.interleaved).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import interleaved
from bench.kernels import parse_shapes
from model.linear import linear, pack
from model.quantized import Int4Weight, Int8Weight, full_range_activations, quantize_per_channel

Kernel = Callable[[torch.Tensor], torch.Tensor]  # x [rows, in] float32 -> [rows, out] float32
SLOWER_THAN_FLOAT = 8.0


def with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def int8_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> Kernel:
    """Activations quantized per row (symmetric) in PyTorch, then torch._int_mm."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-30) / 127  # [out]
    weight_t = torch.round(weight / scale[:, None]).to(torch.int8).t()  # [in, out] view of [out, in]

    def run(x: torch.Tensor) -> torch.Tensor:
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30) / 127  # [rows, 1]
        xq = torch.round(x / x_scale).to(torch.int8)
        return with_bias(torch._int_mm(xq, weight_t).float().mul_(scale).mul_(x_scale), bias)

    return run


def int8_weight_only(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Kernel:
    scale = weight.abs().amax(dim=1).clamp_min(1e-30) / 127
    qweight = torch.round(weight / scale[:, None]).to(torch.int8)  # [out, in]
    scale, bias_d = scale.to(dtype), None if bias is None else bias.to(dtype)
    return lambda x: with_bias(torch._weight_int8pack_mm(x.to(dtype), qweight, scale), bias_d).float()


def int4_float_activations(int4: Int4Weight, bias: torch.Tensor | None) -> Kernel:
    """The served int4 weights, multiplied by float32 activations (the kernel then takes float32
    scales and zeros)."""
    scales_zeros = int4.scales_zeros.float()

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x, int4.packed, int4.group, scales_zeros)[:, :int4.shape[0]]
        return with_bias(y, bias)

    return run


def int4_dynamic(weight: torch.Tensor, bias: torch.Tensor | None, group: int = 32) -> Kernel:
    n_out, n_in = weight.shape
    grouped = weight.view(n_out, n_in // group, group)
    scale = grouped.abs().amax(-1).clamp_min(1e-30) / 7  # [out, groups]
    q = (torch.round(grouped / scale[..., None]).clamp(-8, 7).view(n_out, n_in) + 8).to(torch.uint8)
    nibbles = (q[:, 1::2] << 4 | q[:, ::2]).contiguous()  # [out, in / 2]
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(nibbles, scale, bias, group, n_in, n_out)
    return lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, group, n_in, n_out)


def kernels(weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, Kernel]:
    """weight [out, in] float32 -> every kernel, each ready to run."""
    packed = pack(weight)
    per_tensor = torch.ops.quantized.linear_prepack(quantize_per_channel(weight), bias)
    served = Int8Weight(weight)
    int4 = Int4Weight(weight)
    return {
        "fp32 oneDNN packed": lambda x: linear(x, weight, bias, packed),
        "fp32 F.linear": lambda x: F.linear(x, weight, bias),
        "FBGEMM int8 per-tensor act": lambda x: torch.ops.quantized.linear_dynamic(x, per_tensor, True),
        "FBGEMM int8 per-row act (served)": lambda x: served(x, bias),
        "_int_mm int8 per-row act": int8_rows(weight, bias),
        "int8pack_mm fp32 act": int8_weight_only(weight, bias, torch.float32),
        "int8pack_mm bf16 act": int8_weight_only(weight, bias, torch.bfloat16),
        "int4pack_mm g64 bf16 act (served)": lambda x: int4(x, bias),
        "int4pack_mm g64 fp32 act": int4_float_activations(int4, bias),
        "dyn_quant_matmul_4bit g32": int4_dynamic(weight, bias),
    }


def relative_error(kernel: Kernel, x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((kernel(x) - reference).norm() / reference.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's (the server's default too)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU seconds (all threads), for a machine others share")
    args, shapes = parse_shapes(parser)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    generator = torch.Generator().manual_seed(0)
    groups = {}
    for n_in, n_out in shapes.blocks:
        groups[f"{n_in}x{n_out}"] = [
            (torch.randn(n_out, n_in, generator=generator) * 0.02, torch.randn(n_out, generator=generator) * 0.02)
            for _ in range(shapes.layers)
        ]
    groups[f"lm head {shapes.width}x{shapes.vocab}"] = [
        (torch.randn(shapes.vocab, shapes.width, generator=generator) * 0.02, None)]
    prepared = {name: [kernels(w, b) for w, b in mats] for name, mats in groups.items()}
    names = list(next(iter(prepared.values()))[0])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, FBGEMM 8-bit activations exact: {full_range_activations()}")

    errors = {k: 0.0 for k in names}
    for name, mats in groups.items():  # LayerNorm-like inputs: unit variance
        x = torch.randn(8, mats[0][0].shape[1], generator=generator)
        reference = F.linear(x, *mats[0])
        for k in names:
            errors[k] = max(errors[k], relative_error(prepared[name][0][k], x, reference))

    totals: dict[int, dict[str, float]] = {}
    skipped: set[str] = set()
    for rows in args.rows:
        totals[rows] = {}
        live = [k for k in names if k not in skipped]
        for name, mats in groups.items():
            xs = [torch.randn(rows, w.shape[1], generator=generator) for w, _ in mats]
            runs = {k: (lambda k=k: [p[k](x) for p, x in zip(prepared[name], xs)]) for k in live}
            best = {k: min(v) for k, v in interleaved(runs, args.reps, clock=clock).items()}
            for k, seconds in best.items():
                totals[rows][k] = totals[rows].get(k, 0.0) + seconds
        reference = totals[rows]["fp32 oneDNN packed"]
        skipped |= {k for k, s in totals[rows].items() if s > SLOWER_THAN_FLOAT * reference}

    print(f"\nms for one decode step's {shapes.products} products ({args.clock} clock; x: vs fp32 oneDNN packed)")
    print(f"{'kernel':34s} " + " ".join(f"{f'{r} rows':>15s}" for r in args.rows) + f" {'rel. error':>11s}")
    for k in names:
        cells = []
        for rows in args.rows:
            seconds = totals[rows].get(k)
            speedup = totals[rows]["fp32 oneDNN packed"] / seconds if seconds else 0.0
            cells.append(f"{seconds * 1e3:7.1f} ({speedup:4.2f}x)" if seconds else f"{'skipped':>15s}")
        print(f"{k:34s} " + " ".join(cells) + f" {errors[k]:11.2e}")


if __name__ == "__main__":
    main()
