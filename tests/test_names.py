"""Every name the project's code reads is defined: pyflakes over every module, its undefined-name
findings as failures. A branch that runs only on a GPU (or any path no CPU test takes) would
otherwise carry such a mistake to the first machine that takes it: `torch` used, never imported,
in the CUDA branch of the engine core's start-up stopped every CUDA server, while CPU CI passed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pyflakes import checker, messages

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "model", "weights", "bench", "tests")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_read_is_defined(package):
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for message in checker.Checker(tree, filename=str(path.relative_to(REPO))).messages:
            if isinstance(message, UNDEFINED):
                found.append(str(message))
    assert found == []
