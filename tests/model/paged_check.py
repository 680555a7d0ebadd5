"""The paged decode kernel (model/paged_kernel.py) against the gather path, on one device.

    TRITON_INTERPRET=1 python -m tests.model.paged_check cpu     # Triton's interpreter (CPU tests)
    python -m tests.model.paged_check cuda                       # compiled (the CUDA lane)

Run by tests/model/test_paged_attention.py: in a subprocess on the CPU, where the interpreter
must be chosen before Triton is first imported; in process on CUDA. Exits 1 naming what differs.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from model.config import GPT2Config
from model.gpt2 import GPT2
from model.kv_cache import KVCache
from model.paged_attention import paged_decode
from weights.checkpoint import build_model
from weights.random_init import init_state

# A tiny GPT-2, and the same with head_dim 80 (Cerebras-GPT 2.7B's): the kernel pads to 128.
CONFIGS = (GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4),
           GPT2Config(vocab_size=512, n_positions=128, n_embd=160, n_layer=1, n_head=2))
LENGTHS = (1, 16, 17, 70, 127)  # one position, a whole block, one past, several tiles, the context
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def kernel_against_sdpa(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The kernel over scattered blocks against SDPA over the same keys copied out, per row."""
    problems = []
    generator = torch.Generator().manual_seed(0)
    for d in (64, 80):
        H, block, blocks = 3, 16, 48
        kv = torch.randn(2, H, (blocks + 1) * block, d, generator=generator).to(device, dtype)
        tables = torch.zeros(len(LENGTHS), 8, dtype=torch.long)
        order = (torch.randperm(blocks, generator=generator) + 1).tolist()  # block 0 is scratch
        for b, length in enumerate(LENGTHS):
            count = -(-length // block)
            tables[b, :count] = torch.tensor([order.pop() for _ in range(count)])
        q = torch.randn(len(LENGTHS), H, d, generator=generator).to(device, dtype)
        lengths = torch.tensor(LENGTHS, device=device)
        out = paged_decode(q, kv, tables.to(device), lengths, 1 / math.sqrt(d), block)
        for b, length in enumerate(LENGTHS):
            positions = (tables[b, :, None] * block + torch.arange(block)).reshape(-1)[:length].to(device)
            ref = F.scaled_dot_product_attention(q[b][:, None].float(), kv[0][:, positions].float(), kv[1][:, positions].float())
            error = (out[b].float() - ref[:, 0]).abs().max().item()
            if not error <= TOLERANCE[dtype]:
                problems.append(f"kernel, head_dim {d}, {dtype}, length {length}: max |paged - SDPA| {error:.3g}")
    return problems


def grown_rows(config: GPT2Config, device: torch.device, dtype: torch.dtype, decode_attention: str,
               lengths: list[int]) -> tuple[KVCache, list[int]]:
    """Rows grown a block at a time in turn, so each row's blocks are scattered through the pool
    (fewer blocks than full rows: no homes)."""
    cache = KVCache(config, len(lengths) + 1, config.n_positions, device, dtype,
                    num_blocks=(len(lengths) + 1) * 8 - 1, decode_attention=decode_attention)
    slots = cache.allocate(len(lengths) + 1, tokens=0)
    for tokens in range(16, config.n_positions + 16, 16):
        for slot, length in zip(slots, lengths):
            cache.ensure(slot, min(tokens, length + 1))
    return cache, slots


def model_against_gather(device: torch.device, dtype: torch.dtype) -> list[str]:
    """A decode step's logits, paged against the gather path, exact and with a static step's
    length bucket and a padding row (service/engine/graphs.py)."""
    problems = []
    for config in CONFIGS:
        model = build_model(GPT2, config, init_state(config, seed=1), device).to(dtype)
        lengths = [5, 37, 70]
        generator = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths]
        logits = {}
        for kind in ("gather", "paged"):
            cache, slots = grown_rows(config, device, dtype, kind, lengths)
            for slot, prompt in zip(slots, prompts):
                model(prompt[None].to(device), None, cache, cache.batch([slot]))
            if kind == "paged":
                cache.read = cache.read_rows = None  # the paged step must not read through these
            tokens = torch.tensor([[int(p[-1])] for p in prompts] + [[0]], device=device)
            positions = torch.tensor([[n] for n in lengths] + [[config.n_positions - 1]], device=device)
            exact = model(tokens[:-1], positions[:-1], cache, cache.batch(slots[:-1])).logits[:, -1]
            static = model(tokens, positions, cache, cache.batch(slots), kv_length=config.n_positions,
                           exact_kv_length=False).logits[:-1, -1]  # the padding row's logits are not read
            logits[kind] = (exact.float(), static.float())
        for name, paged, gathered in zip(("exact", "static"), logits["paged"], logits["gather"]):
            error = (paged - gathered).abs().max().item()
            if not error <= 50 * TOLERANCE[dtype]:
                problems.append(f"model n_embd {config.n_embd}, {dtype}, {name} step: max |paged - gather| logits {error:.3g}")
    return problems


def main(argv: list[str]) -> int:
    device = torch.device(argv[0] if argv else "cpu")
    dtypes = (torch.float32,) if device.type == "cpu" else (torch.float32, torch.float16)
    problems = [p for dtype in dtypes for p in kernel_against_sdpa(device, dtype) + model_against_gather(device, dtype)]
    print("\n".join(problems) or "paged decode agrees with the gather path")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
