"""Static checks on imports: transformers is a test reference only; model/ stands alone; the
HTTP side and the analysis import each other not at all."""

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


HTTP_LIBRARIES = {"fastapi", "starlette", "uvicorn", "h11", "httptools", "httpx"}


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


def module_imports(path: Path, package: str) -> set[str]:
    """Every module a file in `package` imports: relative imports resolved, and `from a import b`
    counted as a and a.b too, since b may be a module (`from service import http`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


# The app's assembly (service/app.py, and service/routes_adapters.py beside it) sits above the HTTP side and the analysis, which import
# each other not at all; what both need is in service/common/, which imports neither.
ONE_WAY = {
    "service/http": ("service.analysis", "service.app", "service.routes_adapters"),
    "service/analysis": ("service.http", "service.app", "service.routes_adapters"),
    "service/common": ("service.http", "service.analysis", "service.app", "service.routes_adapters"),
}


def reaches(module: str, forbidden: tuple[str, ...]) -> bool:
    return any(module == each or module.startswith(each + ".") for each in forbidden)


@pytest.mark.parametrize("folder", sorted(ONE_WAY))
def test_import_arrows_between_the_http_side_and_the_analysis_run_one_way(folder):
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    offenders = {}
    for path in files:
        package = ".".join(path.relative_to(REPO).parent.parts)
        bad = sorted(m for m in module_imports(path, package) if reaches(m, ONE_WAY[folder]))
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert not offenders, f"{folder}/ must not import {', '.join(ONE_WAY[folder])}: {offenders}"


def test_arrow_scan_sees_every_spelling(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import service.analysis.report\n"
        "from service import http\n"
        "def f():\n    from ..analysis import routes\n"
        "from . import errors\n"
    )
    found = module_imports(sample, "service.common")
    assert {"service.analysis.report", "service.http", "service.analysis.routes", "service.common.errors"} <= found
    assert reaches("service.http", ONE_WAY["service/common"]) and not reaches("service.httpx", ONE_WAY["service/common"])


# The analysis process (service/analysis/process.py) is spawned beside the engine core: like the
# core it loads without the HTTP stack, and only its protocol's messages cross to the HTTP side.
# Its adapters reuse the engine core's serving rules (service/engine/adapters.py, model-only), and
# it freezes its start-up heap as the core does (service/engine/gc_heap.py, standard library only).
ANALYSIS_PROCESS_FILES = ("process", "protocol", "report", "figure", "adapters")


def test_the_analysis_process_imports_nothing_of_the_http_stack():
    allowed = tuple(f"service.analysis.{name}" for name in ANALYSIS_PROCESS_FILES) + (
        "service.engine.adapters", "service.engine.gc_heap")
    offenders = {}
    for name in ANALYSIS_PROCESS_FILES:
        modules = module_imports(REPO / "service" / "analysis" / f"{name}.py", "service.analysis")
        bad = {m for m in modules if m.split(".")[0] in HTTP_LIBRARIES}
        bad |= {m for m in modules if m.startswith("service.") and not reaches(m, allowed)}
        if bad:
            offenders[name] = sorted(bad)
    assert not offenders, f"the analysis process imports the HTTP side: {offenders}"
