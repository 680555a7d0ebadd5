"""A real `python -m service` process on loopback for the live tests: bounded waits, always
stopped, and helpers to read its state over HTTP."""

from __future__ import annotations

import ipaddress
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from tests.processes import STARTUP_TIMEOUT_S, clean_env, engine_core_pid, free_port

WAIT_S = 60  # every wait for the server to reach a state is bounded by this
# The --api-servers lane: GPT2_TEST_API_SERVERS=2 (make test-api-servers) runs every live server
# as several HTTP processes in front of one engine core.
API_SERVERS = os.environ.get("GPT2_TEST_API_SERVERS")


class LiveServer:
    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # Read the log as it comes: a server that logs more than a pipe holds would block on it.
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)
        self.reader.start()

    def log(self, wait_for_exit: bool = False) -> str:
        if wait_for_exit:
            self.reader.join(timeout=WAIT_S)
        return "".join(self.lines)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def engine_core_pid(self) -> int:
        return engine_core_pid(self.process.pid)

    def slots_used(self) -> int:
        return self.get("/info").json()["kv_cache"]["slots_used"]

    def metric(self, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise KeyError(name)


@contextmanager
def live_server(model_dir: Path, open_files: int | None = None, env: dict[str, str] | None = None,
                startup_s: float = STARTUP_TIMEOUT_S, **flags) -> Iterator[LiveServer]:
    """`open_files`: the server's file-descriptor limit (RLIMIT_NOFILE), to reach it with few connections;
    `env`: variables set in its environment (GPT2_* ones included); `startup_s`: how long it may take to start."""
    port = free_port()
    if API_SERVERS is not None:
        flags.setdefault("api_servers", API_SERVERS)
    command = [sys.executable, "-m", "service", "--model-dir", str(model_dir), "--port", str(port), "--threads", "1"]
    for name, value in flags.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # the CLI's switches: --flag / --no-flag
            command.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            command += ["--" + flag, str(value)]
    limit = None if open_files is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files)))
    process = subprocess.Popen(
        command, cwd=REPO, env={**clean_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=limit,
    )
    server = LiveServer(process, port)
    try:
        wait_until(lambda: _healthy(server), startup_s, "the server to answer /health")
        yield server
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _healthy(server: LiveServer) -> bool:
    if server.process.poll() is not None:
        raise AssertionError(f"server exited early:\n{server.log(wait_for_exit=True)[-3000:]}")
    try:
        return server.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def _is_loopback(host) -> bool:
    if not isinstance(host, str):
        return True  # AF_UNIX paths and the like: not the network
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def forbid_network(monkeypatch) -> None:
    """Any connection or name lookup beyond loopback fails the test at once (here it would hang)."""
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise AssertionError(f"a client tried the network: connect to {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not _is_loopback(host if isinstance(host, str) else host.decode()):
            raise AssertionError(f"a client tried the network: lookup of {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
