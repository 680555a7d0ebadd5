"""The source document's experiment (seeds/001, §2.3), run through transformers: the reference.

Its script, minus the padding docs/analysis.md explains we leave out: one text at a time (batch size 1),
`AutoModel` with eager attention and `output_attentions=True`, `svdvals(head).max()` per
head, averaged per layer over texts and heads. The script's float32 `svdvals` is taken in float64
here: on CUDA torch's default driver (cuSOLVER's Jacobi gesvdj) is off by up to 3e-3 in float32,
which would make the reference, not the analysis, the inaccurate side.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer


def load_document_model(model_dir: Path):
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def load_document_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def document_sigmas(model, token_ids: list[list[int]]) -> torch.Tensor:
    """σ_max of every head, [n_texts, n_layer, n_head], float32, of the script's float32 heads."""
    per_text = []
    for ids in token_ids:
        attentions = model(torch.tensor([ids], device=model.device), output_attentions=True).attentions
        per_text.append(
            torch.stack([torch.stack([torch.linalg.svdvals(head.double()).max().float() for head in layer[0]]) for layer in attentions])
        )
    return torch.stack(per_text).cpu()


def document_curve(model, token_ids: list[list[int]]) -> list[float]:
    """The document's figure: per layer, the mean over texts and heads."""
    sigmas = document_sigmas(model, token_ids)  # [S, L, H]
    return [sigmas[:, layer].mean().item() for layer in range(sigmas.shape[1])]


@torch.no_grad()
def residual_stream(model, ids: list[int]) -> list[torch.Tensor]:
    """Embeddings, then the residual stream after each block, the last one before ln_f.

    transformers' last hidden state is after ln_f, so the input of ln_f is captured instead.
    """
    captured = []
    hook = model.ln_f.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        hidden = model(torch.tensor([ids], device=model.device), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return [h[0].cpu() for h in hidden[:-1]] + [captured[0][0].cpu()]
