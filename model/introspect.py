"""What the model computes inside, for one short token sequence: every layer's attention
probabilities, and the logit lens (the LM head read after every layer).

Pure functions on the model; service/analysis/inspection.py bounds and serves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.analysis import lora_of
from model.gpt2 import GPT2
from model.lora import AppliedAdapter


@torch.inference_mode()
def attention_maps(model: GPT2, token_ids: list[int], layers: list[int], adapter: AppliedAdapter | None = None) -> torch.Tensor:
    """Attention probabilities of the chosen layers: [len(layers), H, T, T] float32 (row: query);
    with `adapter`, of the fine-tuned model."""
    ids = torch.tensor([token_ids], device=model.device)  # [1, T]
    last = torch.tensor([len(token_ids) - 1], device=model.device)  # [1]: the LM head runs once
    out = model(ids, logits_index=last, output_attentions=True, **lora_of(adapter, 1))
    return torch.stack([out.attentions[layer][0] for layer in layers]).cpu()  # [layers, H, T, T]


@dataclass
class LensTop:
    ids: torch.Tensor  # [L + 1, T, k] most likely next tokens, read after the embeddings and each block
    logprobs: torch.Tensor  # [L + 1, T, k]


@torch.inference_mode()
def logit_lens(model: GPT2, token_ids: list[int], k: int, adapter: AppliedAdapter | None = None) -> LensTop:
    """nostalgebraist's logit lens: the final LayerNorm and LM head applied to the residual stream
    after the embeddings and after each block; the last entry is the model's own output."""
    ids = torch.tensor([token_ids], device=model.device)  # [1, T]
    out = model(ids, output_hidden_states=True, **lora_of(adapter, 1))
    hidden = torch.stack(out.hidden_states)[:, 0]  # [L + 1, T, C]
    logits = model.lm_head(model.ln_f(hidden)).float()  # [L + 1, T, V]
    top, index = logits.topk(k, dim=-1)  # [L + 1, T, k]
    return LensTop(index.cpu(), (top - logits.logsumexp(dim=-1, keepdim=True)).cpu())
