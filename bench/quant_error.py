"""What quantization costs in accuracy, measured as llama.cpp's `perplexity --kl-divergence` does.

    .venv/bin/python -m bench.quant_error --model-dir weights/shakespeare                   # int8
    .venv/bin/python -m bench.quant_error --model-dir weights/shakespeare --quantize int4
    .venv/bin/python -m bench.quant_error --model-dir weights/gpt2 --max-windows 32 --batch 1   # random init

The float model and the quantized one (`GPT2.quantize`, as the engine core serves it) read the
same held-out text: the four works weights.train never trained on (weights/corpus.py), in
windows of the model's context that share one token, so every token after the first is scored
once (weights.trainer.heldout_windows, as the training's own held-out loss). Printed: each
model's perplexity, the KL divergence KL(float || quantized) of the next-token distributions
(mean, 99th percentile, max over every scored token) and how often both put the same token on
top. On a random-init model the numbers say how the arithmetic differs, nothing about text.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from model.gpt2 import GPT2
from model.quantized import QUANTIZE_MODES
from weights.checkpoint import load_model
from weights.corpus import load_corpus
from weights.prepare import CACHE_DIR
from weights.tokenizer import GPT2Tokenizer
from weights.train import token_stream
from weights.trainer import heldout_windows


def compare(reference: GPT2, quantized: GPT2, windows: list[np.ndarray], batch: int) -> dict:
    """Per scored token: NLL under each model, KL(reference || quantized), same top-1 or not."""
    nll_ref, nll_q, kl, same = [], [], [], []
    with torch.inference_mode():
        full = [w for w in windows if len(w) == len(windows[0])]
        groups = [full[i:i + batch] for i in range(0, len(full), batch)]
        groups += [[w] for w in windows if len(w) != len(windows[0])]  # the last, shorter window alone
        for group in groups:
            ids = torch.from_numpy(np.stack(group))  # [B, T + 1]
            inputs, targets = ids[:, :-1], ids[:, 1:]
            logp = reference(inputs).logits.float().log_softmax(-1)  # [B, T, V]
            logq = quantized(inputs).logits.float().log_softmax(-1)  # [B, T, V]
            nll_ref.append(-logp.gather(-1, targets[..., None]).flatten().double())
            nll_q.append(-logq.gather(-1, targets[..., None]).flatten().double())
            kl.append((logp.exp() * (logp - logq)).sum(-1).flatten())
            same.append((logp.argmax(-1) == logq.argmax(-1)).flatten())
    nll_ref, nll_q, kl, same = (torch.cat(v) for v in (nll_ref, nll_q, kl, same))
    return {
        "tokens": len(kl),
        "nll_reference": nll_ref.mean().item(),
        "nll_quantized": nll_q.mean().item(),
        "kl_mean": kl.double().mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": same.double().mean().item(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/shakespeare"))
    parser.add_argument("--quantize", default="int8", choices=[m for m in QUANTIZE_MODES if m != "none"],
                        help="the mode to compare with float32 (GPT2.quantize)")
    parser.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    parser.add_argument("--batch", type=int, default=2, help="windows per forward")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    reference = load_model(args.model_dir)
    quantized = load_model(args.model_dir)
    quantized.quantize(args.quantize)
    context = reference.config.n_positions
    _, held = load_corpus(CACHE_DIR)
    stream = token_stream(held, GPT2Tokenizer.from_dir(args.model_dir))
    windows = heldout_windows(stream, context)[:args.max_windows]
    started = time.perf_counter()
    result = compare(reference, quantized, windows, args.batch)
    config = reference.config

    print(f"{args.model_dir}: {config.n_layer} layers x {config.n_embd}, context {context}; held out "
          f"{', '.join(w.title for w in held)}")
    print(f"{result['tokens']:,} tokens scored in {len(windows)} windows ({time.perf_counter() - started:.0f} s)\n")
    ppl_ref, ppl_q = math.exp(result["nll_reference"]), math.exp(result["nll_quantized"])
    bytes_ref, bytes_q = reference.served_weight_bytes(), quantized.served_weight_bytes()
    print(f"{'weights':10s} {'perplexity':>11s} {'NLL nats/token':>15s} {'served weight MB':>17s}")
    print(f"{'float32':10s} {ppl_ref:11.3f} {result['nll_reference']:15.5f} {bytes_ref / 1e6:17.1f}")
    print(f"{args.quantize:10s} {ppl_q:11.3f} {result['nll_quantized']:15.5f} {bytes_q / 1e6:17.1f}"
          f"   perplexity {100 * (ppl_q / ppl_ref - 1):+.3f}%, served weights {100 * bytes_q / bytes_ref:.1f}% of float32's")
    print(f"\nKL(float32 || {args.quantize}) per token, nats: mean {result['kl_mean']:.6f}, "
          f"99th percentile {result['kl_p99']:.6f}, max {result['kl_max']:.4f}")
    print(f"top-1 agreement: {100 * result['top1_agreement']:.3f}%")


if __name__ == "__main__":
    main()
