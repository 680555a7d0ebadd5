"""Helpers for tests that start real processes (servers, Prometheus) on loopback."""

from __future__ import annotations

import os
import socket
from pathlib import Path

STARTUP_TIMEOUT_S = 120  # a busy shared CPU can take long to import torch; never hang past this


def clean_env() -> dict[str, str]:
    # The test's own GPT2_* settings must not leak into the server it starts.
    return {k: v for k, v in os.environ.items() if not k.startswith("GPT2_")}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


ANALYSIS_PROCESS_NAME = "gpt2-analysis"  # service/analysis/process.py names itself so


def engine_core_pid(server_pid: int) -> int:
    """The server's engine core: its child process started by multiprocessing's spawn that is
    not the analysis process."""
    for pid in _spawned(server_pid):
        if _name(pid) != ANALYSIS_PROCESS_NAME:
            return pid
    raise LookupError(f"process {server_pid} has no engine core process")


def analysis_pids(server_pid: int) -> list[int]:
    """The server's analysis processes (one, whatever --api-servers)."""
    return [pid for pid in _spawned(server_pid) if _name(pid) == ANALYSIS_PROCESS_NAME]


def _spawned(server_pid: int) -> list[int]:
    return [pid for pid, parent, command in _processes() if parent == server_pid and b"spawn_main" in command]


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_server_pids(server_pid: int) -> list[int]:
    """The HTTP processes of a server started with --api-servers N (service/workers.py)."""
    return [pid for pid, parent, command in _processes() if parent == server_pid and b"service.workers" in command]


def _processes() -> list[tuple[int, int, bytes]]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            found.append((int(stat.parent.name), parent, (stat.parent / "cmdline").read_bytes()))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while we looked
    return found


def connection_owner(pids: list[int], client_port: int) -> int | None:
    """Which of `pids` holds the server end of the loopback TCP connection from `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == client_port:
                inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        try:
            if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    return None
