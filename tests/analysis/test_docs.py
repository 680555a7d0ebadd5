"""The analysis is described inside the repository: docs/analysis.md exists, the code points
there, and no tracked file points at a path outside the repository."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

# Absolute paths of the machines the project is developed on, or a climb out of the checkout.
# Written with character classes so this line does not match itself.
OUTSIDE = re.compile(r"[/]work[/]|[.][.][/]shared|shared[/]ANALYSIS[.]md|shared[/]seeds")
TEXT_SUFFIXES = (".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".sh", ".cfg", ".json", "Dockerfile", "Makefile")


def tracked_text_files() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [name for name in names if name.endswith(TEXT_SUFFIXES) and (REPO / name).is_file()]


def test_no_tracked_file_points_outside_the_repository() -> None:
    offenders = []
    for name in tracked_text_files():
        for number, line in enumerate((REPO / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_the_pattern_catches_each_way_out() -> None:
    for parts in (("", "work", "main", "x.py"), ("..", "shared", "x"), ("shared", "ANALYSIS.md"), ("shared", "seeds")):
        assert OUTSIDE.search("/".join(parts)), parts
    assert not OUTSIDE.search("docs/analysis.md")


def test_the_analysis_code_points_to_its_description() -> None:
    assert (REPO / "docs" / "analysis.md").is_file()
    for module in ("model/analysis.py", "model/attention_bounds.py"):
        assert "docs/analysis.md" in (REPO / module).read_text(), module
