"""Static checks on imports: transformers is a test reference only; model/ stands alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def top_level_imports(package: str) -> dict[Path, set[str]]:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    return {path: {name.split(".")[0] for name in imported_modules(path)} for path in files}


@pytest.mark.parametrize("package", ["model", "service"])
def test_no_transformers_import(package):
    offenders = [str(p.relative_to(REPO)) for p, mods in top_level_imports(package).items()
                 if "transformers" in mods]
    assert not offenders, f"transformers imported at run time by {offenders}"


def test_model_does_not_import_service():
    offenders = [str(p.relative_to(REPO)) for p, mods in top_level_imports("model").items()
                 if "service" in mods]
    assert not offenders, f"model/ imports service/ in {offenders}"


def test_scan_sees_imports(tmp_path):
    # The scan itself must catch every spelling of the import, nested or not.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import transformers.models\n"
        "def f():\n    from transformers import GPT2LMHeadModel\n"
        "from . import sibling\n"
    )
    assert imported_modules(sample) == {"transformers.models", "transformers"}


HTTP_LIBRARIES = {"fastapi", "starlette", "uvicorn", "h11", "httpx"}


def test_engine_core_imports_nothing_of_the_http_side():
    # The engine core runs in its own process: it must load without the HTTP stack, and only
    # token ids cross between the two (service/engine/protocol.py).
    offenders = {}
    for path in sorted((REPO / "service" / "engine").rglob("*.py")):
        modules = imported_modules(path)
        bad = {m for m in modules if m.startswith("service.") and not m.startswith("service.engine")}
        bad |= {m for m in modules if m == "service" or m.split(".")[0] in HTTP_LIBRARIES}
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert not offenders, f"the engine core imports the HTTP side: {offenders}"
