"""What one of several HTTP processes (--api-servers N) needs to reach the shared engine core and
to admit requests for the whole server: its number, its socket addresses, the shared counts.

The supervisor (service/workers.py) lays these out in a run directory before any process
starts; every HTTP process finds them there by its number.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

COUNT_BYTES = 8  # one signed 64-bit in-flight count per HTTP process


@dataclass(frozen=True)
class RunDir:
    path: Path
    api_servers: int

    def input_address(self, index: int) -> str:
        return f"ipc://{self.path}/in-{index}"

    def output_address(self, index: int) -> str:
        return f"ipc://{self.path}/out-{index}"

    @property
    def stopping_flag(self) -> Path:
        return self.path / "stopping"

    @property
    def stopping(self) -> bool:
        """The supervisor stops the whole server (not one HTTP process): the core drains too."""
        return self.stopping_flag.exists()

    @property
    def counts_file(self) -> Path:
        return self.path / "in-flight"

    @property
    def metrics_dir(self) -> Path:
        return self.path / "metrics"  # prometheus_client's multiprocess files

    def create(self) -> None:
        self.metrics_dir.mkdir(parents=True)
        self.counts_file.write_bytes(bytes(COUNT_BYTES * self.api_servers))


class SharedInFlight:
    """Requests admitted and not finished, per HTTP process, in a file every process maps.

    Admission takes an exclusive flock on the file, so check-and-add is one step for the whole
    server and a refusal is still immediate; the kernel drops the lock of a process that dies,
    so a crash cannot wedge admission.
    """

    def __init__(self, run_dir: RunDir, index: int) -> None:
        self.index = index
        self._fd = os.open(run_dir.counts_file, os.O_RDWR)
        self._map = mmap.mmap(self._fd, COUNT_BYTES * run_dir.api_servers)
        self._counts = memoryview(self._map).cast("q")
        self.publish(0)  # a restarted process starts with nothing: its predecessor's are cancelled

    def admit(self, count: int, limit: int) -> int | None:
        """Add `count` to this process's share if the server stays within `limit`; otherwise
        return the server's total in flight (and add nothing)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            total = sum(self._counts)
            if total + count > limit:
                return total
            self._counts[self.index] += count
            return None
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def publish(self, count: int) -> None:
        """This process's count after requests finished (an aligned 8-byte store: no lock)."""
        self._counts[self.index] = count


@dataclass(frozen=True)
class CoreLink:
    run_dir: RunDir
    index: int
    # The supervisor's pid: while this process waits for the core's first answer, the
    # supervisor's end means no core will ever answer (CoreProcess.start stops waiting).
    supervisor_pid: int

    @property
    def input_address(self) -> str:
        return self.run_dir.input_address(self.index)

    @property
    def output_address(self) -> str:
        return self.run_dir.output_address(self.index)
