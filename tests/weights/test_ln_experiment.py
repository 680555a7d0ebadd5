"""The Pre-LN/Post-LN experiment's pipeline on a micro run (the real one is opt-in, ~30 min):
what it records per run has the shapes the figures and the table read, and its numbers obey
what must hold (‖A‖₂ ≥ 1, finite gradient norms, one per block)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.weights.test_train import MICRO
from weights.ln_experiment import GRAD_EVERY, draw, markdown_table, run_one


@pytest.mark.parametrize("architecture", ["pre-ln", "post-ln"])
def test_one_run_records_what_the_figures_read(streams, architecture):
    config = replace(MICRO, architecture=architecture, steps=GRAD_EVERY + 1, optimizer="adamw")
    _, state, result = run_one(config, *streams, checkpoints={0, 3})
    assert state.step == config.steps and not result["diverged"]
    assert [step for step, _ in result["grad_norms"]] == [0, GRAD_EVERY]
    assert all(len(norms) == config.n_layer and all(math.isfinite(g) and g > 0 for g in norms)
               for _, norms in result["grad_norms"])
    assert [step for step, _ in result["spectral_norms"]] == [0, 3, config.steps]
    for _, norms in result["spectral_norms"]:
        assert len(norms) == config.n_layer and all(n >= 1.0 - 1e-5 for n in norms)  # A·1 = 1


def test_table_and_figures_from_results(streams, tmp_path, monkeypatch):
    config = replace(MICRO, steps=2, warmup_steps=1, optimizer="adamw")
    results = {}
    for depth in (1, 2):
        for warm in ("warm-up", "no warm-up"):
            for arch in ("pre-ln", "post-ln"):
                run = replace(config, architecture=arch, n_layer=depth)
                results[f"{arch} {depth}L {warm}"] = run_one(run, *streams, checkpoints={0})[2]
    table = markdown_table(results)
    assert table.count("\n") == 2 + len(results)
    monkeypatch.setattr("weights.ln_experiment.DEPTHS", (1, 2))
    written = draw(results, tmp_path)
    assert [p.name for p in written] == ["ln-loss.svg", "ln-grad-norms.svg", "ln-spectral-norms.svg"]
    assert all(p.read_text().startswith("<?xml") for p in written)
