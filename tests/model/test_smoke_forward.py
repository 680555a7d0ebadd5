import torch

from weights.checkpoint import load_model


def test_tiny_model_loads_and_gives_finite_logits(tiny_model_dir):
    model = load_model(tiny_model_dir)
    ids = torch.tensor([[464, 2068, 7586]])
    logits = model(ids).logits
    assert logits.shape == (1, 3, model.config.vocab_size)
    assert torch.isfinite(logits).all()
