"""What the reliability tests measured, kept for RELIABILITY.md: each test records one JSON file,
and tests/reliability/report.py turns the files of one run into the table."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import REPO

RESULTS_DIR = Path(os.environ.get("RELIABILITY_RESULTS", REPO / "build" / "reliability"))


def record(name: str, values: dict) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def load_all() -> dict[str, dict]:
    if not RESULTS_DIR.is_dir():
        return {}
    return {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS_DIR.glob("*.json"))}
