"""`weights.prepare` builds a loadable folder offline, and never waits on an unreachable hub."""

from __future__ import annotations

import json
import socket

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY
from weights import prepare as prepare_module
from weights.bpe_source import fetch_tiktoken_ranks
from weights.checkpoint import load_model
from weights.names import hf_name
from weights.prepare import CACHE_DIR, ORIGIN_FILE, is_prepared, prepare
from weights.random_init import init_state
from weights.tokenizer import GPT2Tokenizer

SEED = 3


@pytest.fixture
def network(monkeypatch):
    """Every name lookup, internet connection and hub download fails, and is recorded."""
    fetch_tiktoken_ranks(CACHE_DIR)  # the tokenizer source is cached by `make weights`
    log = {"lookups": [], "connects": [], "downloads": []}
    real_connect = socket.socket.connect

    def getaddrinfo(host, port, *args, **kwargs):
        log["lookups"].append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, "name lookup disabled in this test")

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            log["connects"].append(address[:2])
            raise OSError("network disabled in this test")
        return real_connect(sock, address)

    def download(repo_id, filename, **kwargs):
        log["downloads"].append(filename)
        raise OSError("hub disabled in this test")

    def pip_download(*args, **kwargs):
        raise AssertionError(f"no download expected: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr("weights.registry.subprocess.run", pip_download)
    for var in ("HF_HUB_OFFLINE", "GPT2_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return log


def assert_random_init_folder(out, origin: dict, tokenizer: GPT2Tokenizer) -> None:
    assert is_prepared(out)
    assert not out.with_name(out.name + ".partial").exists()
    assert json.loads((out / ORIGIN_FILE).read_text()) == origin
    assert origin["source"] == "random-init" and origin["seed"] == SEED
    assert load_model(out).config == TINY
    # The written tensors are the seed's init, in the layout transformers saves.
    stored = load_file(str(out / "model.safetensors"))
    expected = init_state(TINY, seed=SEED)
    assert stored.keys() == {hf_name(n) for n in expected}
    assert all(torch.equal(stored[hf_name(n)], t) for n, t in expected.items())
    text = "GPT-2's tokenizer, rebuilt offline: ✓"
    assert GPT2Tokenizer.from_dir(out).encode(text) == tokenizer.encode(text)


def test_auto_with_unreachable_hub_builds_random_init(tmp_path, network, tokenizer):
    out = tmp_path / "gpt2"
    origin = prepare(out, source="auto", seed=SEED, config=TINY)
    assert network["lookups"] == [(prepare_module.HUB_HOST, 443)]  # one probe, then give up
    assert network["connects"] == [] and network["downloads"] == []
    assert_random_init_folder(out, origin, tokenizer)
    # Prepared already: a second run keeps the folder as it is.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert prepare(out, source="auto", seed=SEED + 1, config=TINY) == origin
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_offline_setting_skips_the_hub_probe(tmp_path, network, monkeypatch, tokenizer):
    monkeypatch.setenv("GPT2_OFFLINE", "1")
    out = tmp_path / "gpt2"
    origin = prepare(out, source="auto", seed=SEED, config=TINY)
    assert network == {"lookups": [], "connects": [], "downloads": []}
    assert_random_init_folder(out, origin, tokenizer)


def test_failed_hub_download_falls_back_in_auto_only(tmp_path, network, monkeypatch):
    monkeypatch.setattr(prepare_module, "hub_reachable", lambda timeout=3.0: True)
    with pytest.raises(OSError, match="hub disabled"):
        prepare(tmp_path / "hub", source="hub", seed=SEED, config=TINY)
    assert sorted(tmp_path.iterdir()) == []  # no folder, no half-built leftovers
    origin = prepare(tmp_path / "auto", source="auto", seed=SEED, config=TINY)
    assert network["downloads"][:1] == ["config.json"]
    assert origin["source"] == "random-init" and is_prepared(tmp_path / "auto")


def test_a_folder_it_did_not_write_is_never_replaced(tmp_path, network, tiny_model_dir):
    """Pointing --out at someone's own model folder must not delete their checkpoint."""
    theirs = tmp_path / "their-model"
    theirs.mkdir()
    for f in tiny_model_dir.iterdir():
        (theirs / f.name).write_bytes(f.read_bytes())
    before = {f.name: f.read_bytes() for f in theirs.iterdir()}
    for force in (False, True):
        with pytest.raises(FileExistsError, match="did not write"):
            prepare(theirs, source="random", seed=SEED, force=force, config=TINY)
    assert {f.name: f.read_bytes() for f in theirs.iterdir()} == before
