"""A model folder or device that cannot be served stops `python -m service` with one line that
says why, never a traceback (an operator reads it in a container log)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import service.http.server
from service.__main__ import main


def never_serve(*args, **kwargs):
    raise AssertionError("the service started")  # a regression must fail here, not serve


def start(*argv: str) -> str:
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as stopped:
        patch.setattr(service.http.server, "serve", never_serve)
        main([*argv])
    message = stopped.value.code
    assert isinstance(message, str), f"exited with {message!r}, not a message"
    assert message.startswith("cannot start: ") and "\n" not in message, message
    return message


def broken_copy(tiny_model_dir: Path, tmp_path: Path, name: str, content: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / name).write_text(content)
    return folder


def test_a_corrupt_tokenizer_json_is_one_line(tiny_model_dir, tmp_path):
    folder = broken_copy(tiny_model_dir, tmp_path, "tokenizer.json", '{"model": {"ty')
    assert "tokenizer.json" in start("--model-dir", str(folder))


def test_a_config_nested_too_deeply_is_one_line(tiny_model_dir, tmp_path):
    folder = broken_copy(tiny_model_dir, tmp_path, "config.json", "[" * 100_000 + "]" * 100_000)
    assert "config.json" in start("--model-dir", str(folder))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA: --device cuda is servable")
def test_cuda_on_a_cpu_build_of_torch_is_one_line(tiny_model_dir):
    assert "cuda" in start("--model-dir", str(tiny_model_dir), "--device", "cuda").lower()


def test_a_chat_template_that_cannot_serve_is_one_line(tiny_model_dir, tmp_path):
    assert "no such file" in start("--model-dir", str(tiny_model_dir), "--chat-template", "missing.jinja")
    assert "does not parse" in start("--model-dir", str(tiny_model_dir), "--chat-template", "{% for %}")
    folder = broken_copy(tiny_model_dir, tmp_path, "chat_template.jinja", "{{ messages ")
    assert "chat_template.jinja" in start("--model-dir", str(folder))
