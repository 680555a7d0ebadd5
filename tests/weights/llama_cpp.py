"""llama.cpp's convert_hf_to_gguf.py, taken from the llama.cpp that the llama-cpp-python sdist on
PyPI vendors: the script, its `conversion` package and its `gguf-py`, extracted once into build/
(outside the packages, whose imports tests scan); the sdist is fetched into weights/.cache, beside
the other sdists the project fetches, and removed once extracted."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path, PurePosixPath

from tests.conftest import REPO
from weights.prepare import CACHE_DIR
from weights.registry import fetch_sdist

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = PurePosixPath("llama_cpp_python-0.3.36/vendor/llama.cpp")
# What the converter imports: itself, its model classes, and the gguf writer it ships.
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
SCRIPT = "convert_hf_to_gguf.py"
BUILD_DIR = REPO / "build"


def converter(cache_dir: Path = CACHE_DIR, build_dir: Path = BUILD_DIR) -> Path:
    """The converter script, fetched (once) from PyPI; raises RegistryError when unreachable."""
    folder = build_dir / "llama.cpp-0.3.36"
    if (folder / SCRIPT).exists():
        return folder / SCRIPT
    sdist = fetch_sdist(SDIST, SDIST_FILE, SDIST_SHA256, cache_dir)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            path = PurePosixPath(member.name)
            if not member.isfile() or not path.is_relative_to(VENDORED) or ".." in path.parts:
                continue
            relative = path.relative_to(VENDORED).as_posix()
            if relative.startswith(MEMBERS):
                target = partial / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # published whole: a cut-short extraction is never taken for the script
    sdist.unlink()  # 76 MB, of which the converter needs 1
    return folder / SCRIPT
