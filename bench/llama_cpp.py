"""llama.cpp, built here from the source the `llama-cpp-python` sdist on PyPI vendors (pinned,
sha256-checked), to run beside our server in the same benchmark (bench/bench_serve.py --llama-cpp).

    .venv/bin/python -m bench.llama_cpp build                            # build/llama.cpp/bin/llama-bench, ...
    .venv/bin/python -m bench.llama_cpp convert --model-dir weights/gpt2 # build/gguf/gpt2-{f32,f16,q8_0,q4_0}.gguf

The vendored tree is extracted once into build/ (outside the packages, whose imports tests scan),
less what neither the build nor the converter reads; the sdist is fetched into weights/.cache,
beside the other sdists the project fetches, and removed once extracted. Only the two benchmark
tools are built, and llama-quantize, which writes the Q4_0 GGUF the converter cannot (from the f32
one, with llama.cpp's own Q4_0 recipe): CPU only, Release, -march=native (GGML_NATIVE), no HTTPS
client.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

from weights.prepare import CACHE_DIR
from weights.registry import fetch_sdist

REPO = Path(__file__).resolve().parents[1]
BUILD_ROOT = REPO / "build"
SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = PurePosixPath("llama_cpp_python-0.3.36/vendor/llama.cpp")
SOURCE_NAME = "llama.cpp-0.3.36"
# 120 of the tree's 176 MB: vocabularies for other models, documentation, images, CI files.
UNUSED = ("models/", "docs/", "media/", ".github/", ".devops/")
SCRIPT = "convert_hf_to_gguf.py"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "ON",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_OPENSSL": "OFF",  # this release's name for what LLAMA_CURL did: downloads, unused here
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_SERVER": "OFF",
    "LLAMA_BUILD_APP": "OFF",
}
GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
# Types the converter cannot write: llama-quantize makes them from the f32 GGUF (its type name).
QUANTIZED_FROM_F32 = {"q4_0": "Q4_0"}
BIN_DIR = BUILD_ROOT / "llama.cpp" / "bin"


def source(cache_dir: Path = CACHE_DIR, build_root: Path = BUILD_ROOT) -> Path:
    """llama.cpp's source tree, fetched (once) from PyPI; raises RegistryError when unreachable."""
    folder = build_root / SOURCE_NAME
    if (folder / "CMakeLists.txt").exists() and (folder / SCRIPT).exists():
        return folder
    sdist = fetch_sdist(SDIST, SDIST_FILE, SDIST_SHA256, cache_dir)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            path = PurePosixPath(member.name)
            if not member.isfile() or not path.is_relative_to(VENDORED) or ".." in path.parts:
                continue
            relative = path.relative_to(VENDORED).as_posix()
            if not relative.startswith(UNUSED):
                target = partial / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
                target.chmod(member.mode & 0o755 | 0o644)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # published whole: a cut-short extraction is never taken for the tree
    sdist.unlink()  # 76 MB, all of it now in the tree
    return folder


def converter(cache_dir: Path = CACHE_DIR, build_root: Path = BUILD_ROOT) -> Path:
    """convert_hf_to_gguf.py, with the `conversion` package and `gguf-py` it imports beside it."""
    return source(cache_dir, build_root) / SCRIPT


def cmake_commands(source_dir: Path, build_dir: Path, jobs: int) -> list[list[str]]:
    configure = ["cmake", "-S", str(source_dir), "-B", str(build_dir), "-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles"]
    configure += [f"-D{name}={value}" for name, value in CMAKE_OPTIONS.items()]
    build = ["cmake", "--build", str(build_dir), "--parallel", str(jobs), "--target", *TOOLS]
    return [configure, build]


def build(build_dir: Path, jobs: int) -> Path:
    """The tools' folder (build_dir/bin); cmake rebuilds only what changed."""
    tree = source()
    for command in cmake_commands(tree, build_dir, jobs):
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    return build_dir / "bin"


def gguf_path(out_dir: Path, model_dir: Path, outtype: str) -> Path:
    return out_dir / f"{model_dir.resolve().name}-{outtype}.gguf"


def convert(model_dir: Path, out_dir: Path, outtypes: tuple[str, ...] = GGUF_TYPES, force: bool = False,
            bin_dir: Path = BIN_DIR) -> list[Path]:
    """GGUFs of a model folder, one per type, written by llama.cpp's own converter, or by its
    llama-quantize (in bin_dir) from the f32 one (skipped when already newer than the folder's
    weights)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    newest_input = max(path.stat().st_mtime for path in model_dir.iterdir() if path.is_file())
    written = []
    for outtype in outtypes:
        out = gguf_path(out_dir, model_dir, outtype)
        if force or not out.exists() or out.stat().st_mtime < newest_input:
            partial = out.with_suffix(".partial")
            if outtype in QUANTIZED_FROM_F32:
                tool = bin_dir / "llama-quantize"
                if not tool.is_file():
                    raise RuntimeError(f"a {outtype} GGUF is written by llama-quantize, not in {bin_dir}: `make llama-cpp` builds it")
                (f32,) = convert(model_dir, out_dir, ("f32",), force, bin_dir)
                command = [str(tool), str(f32), str(partial), QUANTIZED_FROM_F32[outtype]]
            else:
                tool = converter()
                command = [sys.executable, str(tool), str(model_dir), "--outtype", outtype, "--outfile", str(partial)]
            print("+", " ".join(command), flush=True)
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{tool.name} failed on {model_dir}: {result.stderr[-3000:]}")
            partial.rename(out)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help=f"build {', '.join(TOOLS)} with cmake")
    build_parser.add_argument("--out", type=Path, default=BUILD_ROOT / "llama.cpp", help="cmake's build folder")
    build_parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    convert_parser = commands.add_parser("convert", help="GGUFs of a model folder")
    convert_parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    convert_parser.add_argument("--out", type=Path, default=BUILD_ROOT / "gguf")
    convert_parser.add_argument("--outtype", nargs="+", choices=GGUF_TYPES, default=list(GGUF_TYPES))
    convert_parser.add_argument("--force", action="store_true", help="rewrite GGUFs that exist")
    convert_parser.add_argument("--bin-dir", type=Path, default=BIN_DIR, help="where llama-quantize is (for q4_0)")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.out, args.jobs))
    else:
        for path in convert(args.model_dir, args.out, tuple(args.outtype), args.force, args.bin_dir):
            print(path)


if __name__ == "__main__":
    main()
