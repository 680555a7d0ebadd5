"""Static checks on imports: transformers is a test reference only; model/ stands alone; the
HTTP side and the analysis import each other not at all; no module's imports lead back to it."""

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


# --- no import circles ------------------------------------------------------------------------
# The project's own packages (tests excluded). Every import counts: at module level, inside a
# function (a lazy import only defers the circle to the first call) and under TYPE_CHECKING (a
# type checker follows it, and it says the two modules know each other).
PROJECT_PACKAGES = ("model", "service", "weights", "bench")


def project_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Each module's dotted name: its file (a package's is its __init__.py)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_edges(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The project modules `name` (at `path`) imports, each with the line of its first import.
    `import a.b` and `from a import b` lead to module a.b where there is one, else to a; a
    relative import is resolved against the importing module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(dotted: str) -> str | None:  # the most specific project module the name is in
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [owner(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            targets = [owner(f"{source}.{alias.name}") for alias in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != name:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of that import}, over the packages' modules only."""
    modules = project_modules(root, packages)
    return {name: import_edges(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative),
    each sorted, in sorted order: every module of one can reach every other through imports."""
    index_of: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index_of:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index_of[start] = lowlink[start] = len(index_of)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index_of:
                    index_of[successor] = lowlink[successor] = len(index_of)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index_of[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    lowlink[parent] = min(lowlink[parent], lowlink[node])
                if lowlink[node] == index_of[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def describe_cycle(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    arrows = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component]
    return f"{' <-> '.join(component)}: {'; '.join(arrows)}"


def test_no_import_circles():
    graph = import_graph(REPO, PROJECT_PACKAGES)
    assert len(graph) > 100 and graph["model.gpt2"], "the scan found too few modules or imports"
    cycles = import_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(describe_cycle(c, graph) for c in cycles)


def test_the_circle_scan_sees_every_kind_of_import(tmp_path):
    files = {
        "pkg/__init__.py": "",
        # a -> b at module level, b -> c in a function, c -> a under TYPE_CHECKING: one circle.
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "def later():\n    from pkg import c\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import Thing\n",
        # d -> e (a name in e, relatively), e -> nothing of the project: no circle.
        "pkg/d.py": "from .e import helper\nimport os\n",
        "pkg/e.py": "import torch\n",
        # f -> sub.g (relative, a module named in `from . import`), g -> f two levels up: a circle.
        "pkg/f.py": "from .sub import g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/g.py": "from .. import f\n",
        # A package's own __init__ resolves `from . import` against itself: h -> sub.g, and sub.g
        # does not import h.
        "pkg/h/__init__.py": "from ..sub import g\nfrom . import inner\n",
        "pkg/h/inner.py": "",
        "other/x.py": "from pkg.e import helper\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg", "other"))
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.c": 2} and graph["pkg.c"] == {"pkg.a": 3}
    assert graph["pkg.d"] == {"pkg.e": 1} and graph["pkg.e"] == {}
    assert graph["pkg.h"] == {"pkg.sub.g": 1, "pkg.h.inner": 2} and graph["other.x"] == {"pkg.e": 1}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.f", "pkg.sub.g"]]
    # Dropping one arrow of a circle breaks it.
    del graph["pkg.c"]["pkg.a"]
    assert import_cycles(graph) == [["pkg.f", "pkg.sub.g"]]


def test_the_circle_finder_on_graphs_by_hand():
    assert import_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    assert import_cycles({"a": {"b": 1}, "b": {"a": 1}, "c": {"a": 1}}) == [["a", "b"]]
    # Two circles joined at a module are one component; a separate one is its own.
    joined = {"a": {"b": 1}, "b": {"a": 1, "c": 1}, "c": {"b": 1}, "x": {"y": 1}, "y": {"x": 1, "a": 1}}
    assert import_cycles(joined) == [["a", "b", "c"], ["x", "y"]]
    # A long chain, deeper than Python's recursion limit, closed into one circle.
    chain = {f"m{i}": {f"m{i + 1}": 1} for i in range(3000)} | {"m3000": {"m0": 1}}
    assert [len(c) for c in import_cycles(chain)] == [3001]
