"""pyproject.toml's dependencies: every third-party import is declared, every requirement has a
floor, and this environment (where the suite runs) is at or above each floor. `make test-floors`
runs a quick subset at the floors themselves (tests/floors.py)."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.floors import declared, floor, optional, pinned
from tests.model.test_layering import REPO, top_level_imports

RUNTIME, TEST = declared()
FIRST_PARTY = {"model", "service", "weights", "tests"}


def undeclared(packages: list[str], requirements) -> dict[str, list[str]]:
    """Third-party modules imported under `packages` whose distribution none of `requirements` names."""
    names = {canonicalize_name(r.name) for r in requirements}
    distributions = importlib.metadata.packages_distributions()
    found: dict[str, list[str]] = {}
    for package in packages:
        for path, modules in top_level_imports(package).items():
            for module in modules - FIRST_PARTY:
                owners = distributions.get(module)
                if owners and not any(canonicalize_name(d) in names for d in owners) and module != "pip":
                    found.setdefault(module, []).append(str(path.relative_to(REPO)))
    return found


def test_the_code_imports_only_declared_dependencies():
    # The `cuda` extra: what CUDA builds of torch bring (Triton), imported only where it runs.
    assert not undeclared(["model", "service", "weights"], [*RUNTIME, *optional("cuda")]), "add them to [project] dependencies"


def test_the_tests_import_only_declared_dependencies():
    assert not undeclared(["tests"], [*RUNTIME, *TEST]), "add them to the test extra"


@pytest.mark.parametrize("requirement", [*RUNTIME, *TEST], ids=str)
def test_every_requirement_has_a_floor_this_environment_meets(requirement):
    lowest = Version(floor(requirement))
    installed = Version(importlib.metadata.version(requirement.name))
    assert installed >= lowest, f"{requirement.name} {installed} is below its floor {lowest}"
    pin, _, marker = pinned(requirement).partition("; ")
    assert pin.startswith(f"{requirement.name}") and pin.endswith(f"=={lowest}")
    assert marker == (str(requirement.marker) if requirement.marker else "")  # a platform's condition kept
