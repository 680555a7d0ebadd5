"""The engine's parts as the step passes through them: the scheduler plans and reads tokens, the
model runner runs the model; a plan goes down and a launched step comes up through the core, and
neither calls the other (docs/engine.md). Checked on every import, lazy or for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "service" / "engine"

# What runs the model or owns device state for it: the runner's side.
RUNNER_SIDE = {"runner", "input_batch", "layout", "step_sampler", "graphs", "forward", "prompt_scores"}
# What owns requests: the scheduler's side.
SCHEDULER_SIDE = {"scheduler", "step_reader", "prefix_cache", "validation", "waiting"}


def engine_imports(module: str, folder: Path = ENGINE) -> set[str]:
    """The service.engine modules `module` imports anywhere in its text."""
    tree = ast.parse((folder / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["service", "engine"] and len(parts) > 2:
                found.add(parts[2])
    return found


@pytest.mark.parametrize("module", sorted(SCHEDULER_SIDE))
def test_the_scheduler_side_never_reaches_the_runner(module):
    assert not engine_imports(module) & RUNNER_SIDE, f"{module} imports {engine_imports(module) & RUNNER_SIDE}"


@pytest.mark.parametrize("module", sorted(RUNNER_SIDE))
def test_the_runner_side_never_reaches_the_scheduler(module):
    assert not engine_imports(module) & SCHEDULER_SIDE, f"{module} imports {engine_imports(module) & SCHEDULER_SIDE}"


def test_only_the_core_holds_both():
    holders = {path.stem for path in ENGINE.glob("*.py")
               if {"scheduler", "runner"} <= engine_imports(path.stem)}
    assert holders == {"core"}


def test_the_scan_sees_lazy_and_type_checking_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from service.engine.runner import ModelRunner\n"
        "def f():\n    import service.engine.layout\n"
        "from service.engine import step_sampler\n"
    )
    assert engine_imports("sample", tmp_path) == {"runner", "layout", "step_sampler"}
