"""The Dockerfile, read by Docker's own parser (buildkit's, through the `dockerfile` package),
against the repository: what it copies exists, what it runs exists, ports and paths agree."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import runpy
import subprocess

import dockerfile
import pytest

from service.settings import Settings
from tests.deploy.deploy_files import DOCKERFILE, REPO

INSTRUCTIONS = dockerfile.parse_file(str(DOCKERFILE))
ENTRYPOINT_SCRIPT = REPO / "service" / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK_SCRIPT = REPO / "service" / "deploy" / "docker" / "healthcheck.py"


def commands(name: str) -> list[dockerfile.Command]:
    return [c for c in INSTRUCTIONS if c.cmd == name]


def build_args() -> dict[str, str]:
    pairs = (c.value[0].split("=", 1) for c in commands("ARG") if "=" in c.value[0])
    return dict(pairs)


def env() -> dict[str, str]:
    values = [v for c in commands("ENV") for v in c.value]
    return dict(zip(values[::2], values[1::2]))


def copies() -> dict[str, str]:
    """Destination in the image -> source in the build context, for every COPY from the context."""
    found = {}
    for c in commands("COPY"):
        assert not any(f.startswith("--from") for f in c.flags), "multi-stage copies are not expected"
        *sources, dest = c.value
        for source in sources:
            found[dest.rstrip("/") + ("/" + source if dest.endswith("/") else "")] = source
    return found


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path, or one of its parent folders, wins."""
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.lstrip("!")
        globs = [glob, glob.removeprefix("**/")] if glob.startswith("**/") else [glob]
        for prefix in prefixes:
            tail = prefix.rsplit("/", 1)[-1]
            if any(fnmatch.fnmatchcase(prefix, g) or (g != glob and fnmatch.fnmatchcase(tail, g)) for g in globs):
                excluded = not negated
    return excluded


def test_every_copy_source_exists_and_is_sent_to_the_builder():
    sources = set(copies().values())
    assert sources >= {"pyproject.toml", "model", "service", "weights"}
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
        assert not dockerignore_excludes(source), f"COPY {source}: .dockerignore keeps it out of the build context"


@pytest.mark.parametrize(
    "path", [".venv/bin/python", ".git/HEAD", "weights/gpt2/model.safetensors", "weights/.cache/gpt2.tiktoken",
             "model/__pycache__/gpt2.cpython-311.pyc", "tests/conftest.py", "bench/x.py"],
)
def test_dockerignore_keeps_generated_and_unneeded_files_out(path):
    assert dockerignore_excludes(path)


def test_dockerignore_matcher_sees_whitelisted_sources():
    # Guards the helper above: without this, a matcher that excludes everything would pass.
    assert not dockerignore_excludes("weights/prepare.py")
    assert not dockerignore_excludes("service/deploy/docker/entrypoint.sh")


def test_build_argument_selects_a_cuda_or_a_cpu_base():
    stages = {c.value[-1]: c.value[0] for c in commands("FROM") if len(c.value) == 3}
    args = build_args()
    assert args["VARIANT"] == "cuda"
    final_from = commands("FROM")[-1].value[0]
    assert final_from == "base-${VARIANT}"
    assert {"base-cuda", "base-cpu"} <= stages.keys()
    assert stages["base-cuda"] == "${CUDA_BASE}" and "cuda" in args["CUDA_BASE"]
    assert args["CUDA_BASE"].startswith("pytorch/pytorch:") and args["CUDA_BASE"].endswith("-runtime")
    assert stages["base-cpu"] == "${CPU_BASE}" and "slim" in args["CPU_BASE"]
    # VARIANT doubles as the device the image serves on: both values must be valid settings.
    for variant in ("cuda", "cpu"):
        assert Settings(device=variant).device == variant
    assert env()["GPT2_DEVICE"] == "${VARIANT}"


def test_one_torch_version_in_the_cuda_base_the_cpu_image_and_the_makefile():
    args = build_args()
    makefile_pin = re.search(r"^TORCH_CPU\s*\??=\s*torch==(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    cuda_tag_version = args["CUDA_BASE"].split(":", 1)[1].split("-", 1)[0]
    assert args["TORCH_VERSION"] == makefile_pin == cuda_tag_version
    cpu_install = next(c.value[0] for c in commands("RUN") if "torch==" in c.value[0])
    assert '"torch==${TORCH_VERSION}"' in cpu_install
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu_install


def test_project_is_installed_from_pyproject():
    install = next(c.value[0] for c in commands("RUN") if "pip install" in c.value[0] and "/src" in c.value[0])
    assert re.search(r"pip install (--\S+ )*/src(\s|$)", install)
    assert copies()["/src/pyproject.toml"] == "pyproject.toml"


def test_runs_as_a_numeric_non_root_user():
    user = commands("USER")[-1].value[0]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert any(f"--uid {uid}" in c.value[0] for c in commands("RUN"))


def test_settings_come_from_environment_variables_the_service_reads():
    variables = env()
    gpt2_variables = {k for k in variables if k.startswith("GPT2_")}
    unknown = {k for k in gpt2_variables if k.removeprefix("GPT2_").lower() not in Settings.model_fields}
    assert not unknown, f"ENV sets variables service/settings.py does not read: {unknown}"
    # A server bound to 127.0.0.1 in a container is unreachable from outside it.
    assert variables["GPT2_HOST"] == "0.0.0.0"
    assert [c.value for c in commands("EXPOSE")] == [(variables["GPT2_PORT"],)]
    assert commands("VOLUME")[0].value[0] == variables["GPT2_MODEL_DIR"].rsplit("/", 1)[0]


def test_entrypoint_and_healthcheck_are_copied_scripts():
    installed = copies()
    entrypoint = commands("ENTRYPOINT")[-1]
    assert entrypoint.json, "ENTRYPOINT must be exec form so the server gets SIGTERM"
    assert installed["/usr/local/bin/" + entrypoint.value[0]] == ENTRYPOINT_SCRIPT.relative_to(REPO).as_posix()
    healthcheck = commands("HEALTHCHECK")[-1]
    assert healthcheck.value[0] == "CMD"
    assert installed["/usr/local/bin/" + healthcheck.value[1]] == HEALTHCHECK_SCRIPT.relative_to(REPO).as_posix()
    subprocess.run(["sh", "-n", str(ENTRYPOINT_SCRIPT)], check=True)


def test_entrypoint_runs_modules_that_exist():
    modules = re.findall(r"python -m ([\w.]+)", ENTRYPOINT_SCRIPT.read_text())
    assert set(modules) == {"service", "weights.prepare"}
    for module in modules:
        runnable = module + ".__main__" if importlib.util.find_spec(module).submodule_search_locations else module
        assert importlib.util.find_spec(runnable) is not None, f"python -m {module}: nothing to run"


def test_healthcheck_probes_a_route_that_answers(get_status):
    assert get_status(runpy.run_path(str(HEALTHCHECK_SCRIPT))["HEALTH_PATH"]) == 200
