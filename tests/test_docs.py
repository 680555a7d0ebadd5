"""The documentation holds together: README.md is a front page under 250 lines that links every
page of docs/, and every relative link of README.md, docs/*.md and RELIABILITY.md reaches a file
of the repository and, with a #fragment, a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.conftest import REPO

PAGES = [REPO / "README.md", REPO / "RELIABILITY.md", *sorted((REPO / "docs").glob("*.md"))]
FRONT_PAGE_LINES = 250
PARSER = MarkdownIt("commonmark").enable("table")


def inline_text(token) -> str:
    return "".join(child.content for child in token.children or [] if child.type in ("text", "code_inline"))


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    tokens = PARSER.parse(page.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type == "heading_open":
            anchor = github_anchor(inline_text(inline))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")  # repeated headings: -1, -2, ...
    return found


def links(page: Path) -> list[str]:
    """Every link's and image's target."""
    found = []
    for token in PARSER.parse(page.read_text()):
        for child in token.children or []:
            if child.type == "link_open":
                found.append(child.attrs["href"])
            elif child.type == "image":
                found.append(child.attrs["src"])
    return found


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for href in links(page):
        if re.match(r"[a-z]+:", href):  # http(s), mailto: outside the repository by design
            continue
        path, _, fragment = href.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.is_relative_to(root) or not target.exists():
            broken.append(f"{href}: no such file in the repository")
        elif fragment and fragment not in anchors(target):
            broken.append(f"{href}: no heading with that anchor in {target.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    assert not broken_links(page)


def test_the_link_check_sees_broken_links(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "api.md").write_text("# API\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    sample = root / "docs" / "sample.md"
    sample.write_text("# Title\n\n## A `code` heading\n\n## A `code` heading\n\n"
                      "[ok](#a-code-heading-1) [ok](api.md#api) [bad](#nowhere) [bad](missing.md) [bad](../../outside.md)\n"
                      "```\n[not a link](#inside-a-code-block)\n```\n")
    assert broken_links(sample, root) == [
        "#nowhere: no heading with that anchor in docs/sample.md",
        "missing.md: no such file in the repository",
        "../../outside.md: no such file in the repository",
    ]


def test_the_front_page_is_short_and_links_every_page_of_docs():
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) < FRONT_PAGE_LINES
    linked = {(REPO / href.partition("#")[0]).resolve() for href in links(readme)}
    assert not [p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked]


def table(page: Path, first_header: str) -> list[list]:
    """The rows (each a list of its cells' inline tokens) of the table whose first column is headed so."""
    tokens = PARSER.parse(page.read_text())
    tables, rows, header = [], None, None
    for token, following in zip(tokens, tokens[1:]):
        if token.type == "table_open":
            rows, header = [], None
        elif token.type == "tr_open":
            rows.append([])
        elif token.type in ("th_open", "td_open"):
            rows[-1].append(following)
        elif token.type == "table_close":
            tables.append(rows)
    found = [rows[1:] for rows in tables if inline_text(rows[0][0]) == first_header]
    assert len(found) == 1, f"{page.name}: {len(found)} tables headed {first_header!r}"
    return found[0]


def code_names(cell) -> list[str]:
    return [child.content for child in cell.children if child.type == "code_inline"]


def test_the_settings_table_names_every_setting_and_only_settings():
    from service.settings import Settings

    documented = {name for row in table(REPO / "docs" / "api.md", "setting") for name in code_names(row[0])}
    assert documented == set(Settings.model_fields)


def test_the_metrics_table_names_every_metric_with_its_type():
    from service.common.metrics import Metrics

    documented = set()
    for name_cell, type_cell, _ in table(REPO / "docs" / "api.md", "metric"):
        kind = "info" if "info" in inline_text(type_cell) else inline_text(type_cell).strip()
        for name in code_names(name_cell):
            # Exposed names carry _total (counters) and _info; the registry's families do not.
            family = name.split("{")[0].removesuffix("_total" if kind == "counter" else "_info" if kind == "info" else "")
            documented.add((family, kind))
    assert documented == {(family.name, family.type) for family in Metrics().registry.collect()}
