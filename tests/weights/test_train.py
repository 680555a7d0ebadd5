"""A micro training run (seconds): the loss falls, the written folder loads here and in
transformers with the same logits, the restricted softmax is the full one, runs repeat exactly,
and Ctrl-C leaves a usable folder."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.model.hf_reference import LOGIT_TOLERANCE
from tests.weights.conftest import HELD
from weights.checkpoint import load_model
from weights.post_ln import load_post_ln_model
from weights.prepare import ORIGIN_FILE, read_origin
from weights.play_chat import PLAY_TEMPLATE
from weights.train import RECORD_FILE, VOCAB_SIZE, write_folder
from weights.trainer import TiedCrossEntropy, TrainConfig, Trainer, heldout_windows

MICRO = TrainConfig(n_layer=2, n_embd=32, n_head=2, context=32, batch_size=4, steps=30,
                    warmup_steps=3, lr=3e-3, eval_every=10, eval_windows=2)


def trained(streams, config=MICRO, observer=None):
    trainer = Trainer(config, *streams, VOCAB_SIZE)
    return trainer, trainer.run(observer=observer, progress=False)


@pytest.fixture(scope="module")
def micro_run(streams, tmp_path_factory):
    trainer, state = trained(streams)
    out = tmp_path_factory.mktemp("micro") / "shakespeare"
    write_folder(out, trainer, state, trainer.record)
    return trainer, state, out


def test_loss_falls(micro_run):
    trainer, state, _ = micro_run
    losses = [loss for _, loss, _ in trainer.record["train_loss"]]
    assert state.step == MICRO.steps and len(losses) == MICRO.steps
    assert np.mean(losses[-5:]) < losses[0] - 2.0, losses


def test_folder_loads_and_matches_transformers(micro_run, tokenizer):
    from transformers import GPT2LMHeadModel

    _, state, out = micro_run
    ours = load_model(out)
    assert ours.config.vocab_size == VOCAB_SIZE and ours.config.n_positions == MICRO.context
    reference = GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(HELD)[: MICRO.context]])
    with torch.no_grad():
        diff = (ours(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= LOGIT_TOLERANCE
    assert read_origin(out)["source"] == "trained" and read_origin(out)["steps"] == MICRO.steps
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["config"]["n_layer"] == MICRO.n_layer and len(record["train_loss"]) == MICRO.steps
    assert (out / "chat_template.jinja").read_text() == PLAY_TEMPLATE  # chat clients get a play's lines


def test_restricted_softmax_is_the_written_models_full_softmax(micro_run, streams):
    """The NLL the trainer computes (K used rows + one shared row with its offset) equals the NLL
    of the written 50,257-token model, including on held-out tokens training never saw."""
    trainer, _, out = micro_run
    held = streams[1]
    unseen = [t for t in held if t not in set(trainer.space.kept.tolist())]
    assert unseen, "the held-out text must hold tokens the training text lacks"
    windows = heldout_windows(held, MICRO.context)
    model = load_model(out)
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            ids = torch.from_numpy(window)[None]
            logits = model(ids[:, :-1]).logits[0]
            total += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(window) - 1
    assert math.isclose(trainer.heldout_nll(windows), total / count, rel_tol=1e-5)


def test_chunked_loss_and_gradients_equal_autograd(monkeypatch):
    monkeypatch.setattr("weights.trainer.LOSS_CHUNK_ROWS", 7)  # several chunks, one ragged
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (20,), generator=generator)
    offset = torch.zeros(11, dtype=torch.float64)
    offset[-1] = math.log(5)
    ours = TiedCrossEntropy.apply(hidden, weight, targets, offset) * 0.5
    grads = torch.autograd.grad(ours, (hidden, weight))
    expected = F.cross_entropy(hidden @ weight.t() + offset, targets, reduction="sum") * 0.5
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    assert torch.allclose(ours, expected)
    assert all(torch.allclose(a, b) for a, b in zip(grads, expected_grads))


def test_same_seed_same_weights(streams):
    short = replace(MICRO, steps=8)
    first, _ = trained(streams, short)
    second, _ = trained(streams, short)
    other, _ = trained(streams, replace(short, seed=1))
    a, b, c = (t.model.state_dict() for t in (first, second, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_ctrl_c_stops_cleanly_with_a_usable_folder(streams, tmp_path):
    def interrupt(step, model):
        if step == 5:
            raise KeyboardInterrupt

    trainer, state = trained(streams, observer=interrupt)
    assert state.interrupted and state.step == 5 and len(trainer.record["train_loss"]) == 5
    write_folder(tmp_path / "cut", trainer, state, trainer.record)
    assert read_origin(tmp_path / "cut")["steps"] == 5
    assert not (tmp_path / "cut.partial").exists() and (tmp_path / "cut" / ORIGIN_FILE).exists()
    model = load_model(tmp_path / "cut")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_post_ln_twin_writes_a_folder_transformers_reads(streams, tmp_path, tokenizer):
    from transformers import OpenAIGPTLMHeadModel

    trainer, state = trained(streams, replace(MICRO, architecture="post-ln", steps=5))
    write_folder(tmp_path / "post", trainer, state, trainer.record)
    ours = load_post_ln_model(tmp_path / "post")
    reference = OpenAIGPTLMHeadModel.from_pretrained(tmp_path / "post", dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(HELD)[: MICRO.context]])
    with torch.no_grad():
        assert (ours(ids).logits - reference(ids).logits).abs().max().item() <= LOGIT_TOLERANCE


def test_the_engine_serves_the_trained_folder_as_transformers_generates(micro_run, tokenizer):
    """Greedy decoding of the written folder through the serving engine, token for token."""
    from transformers import GPT2LMHeadModel

    from service.engine.types import GenerationRequest, SamplingParams
    from service.inprocess import Engine, EngineConfig

    _, _, out = micro_run
    prompt = tokenizer.encode("Shall I compare thee")
    engine = Engine(load_model(out), tokenizer, EngineConfig(max_slots=2))
    request = GenerationRequest(request_id="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=12, ignore_eos=True),
                                arrival_time=0.0)
    [finished] = engine.generate([request])
    reference = GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                                      eos_token_id=None)[0, len(prompt):].tolist()
    assert finished.sequences[0].token_ids == expected
