"""python -m tests.floors [TEST_DEPENDENCY ...]: pyproject.toml's dependencies pinned at their
floors (`fastapi>=0.165.0` → `fastapi==0.165.0`), and the named ones of the `test` extra.

`make test-floors` installs these pins into a second venv (transitive dependencies resolve to
their newest, as `uv pip compile --resolution lowest-direct` would) and runs a quick subset of the
tests there, so every floor stays a version the tests pass with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip ships
    from pip._vendor import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def declared(pyproject: Path = PYPROJECT) -> tuple[list[Requirement], list[Requirement]]:
    """(runtime dependencies, the `test` extra), as pyproject.toml states them."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return ([Requirement(r) for r in project["dependencies"]],
            [Requirement(r) for r in project["optional-dependencies"]["test"]])


def optional(extra: str, pyproject: Path = PYPROJECT) -> list[Requirement]:
    """An extra's requirements, as pyproject.toml states them."""
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][extra]]


def floor(requirement: Requirement) -> str:
    """The version after `>=`; a requirement without exactly one floor is an error."""
    lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    if len(lower) != 1:
        raise ValueError(f"{requirement}: needs exactly one floor (>=), has {len(lower)}")
    return lower[0]


def pinned(requirement: Requirement) -> str:
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    marker = f"; {requirement.marker}" if requirement.marker else ""  # where it applies, as declared
    return f"{requirement.name}{extras}=={floor(requirement)}{marker}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_dependencies", nargs="*", help="names from the `test` extra to pin as well")
    args = parser.parse_args(argv)
    runtime, test = declared()
    by_name = {canonicalize_name(r.name): r for r in test}
    unknown = [n for n in args.test_dependencies if canonicalize_name(n) not in by_name]
    if unknown:
        parser.error(f"not in the test extra: {', '.join(unknown)}")
    chosen = [by_name[canonicalize_name(n)] for n in args.test_dependencies]
    sys.stdout.write("".join(pinned(r) + "\n" for r in [*runtime, *chosen]))


if __name__ == "__main__":
    main()
