"""bench/serve_clients.py's clients spread over processes: a process that cannot start its clients
fails the whole measure with its reason, not a bare BrokenBarrierError from the release (as before
each process reported its failure). The barrier's abort only makes that come at once instead of
after the release's timeout: a matter of time, which this test does not assert.
(The measure itself runs in gpu_check's smoke run: tests/bench/test_gpu_check.py.)"""

from __future__ import annotations

import socket

import pytest

from bench.serve_clients import drive_in_processes


def test_a_client_process_that_cannot_connect_fails_the_measure_with_its_reason():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(RuntimeError, match="a client process failed: ConnectError"):
        drive_in_processes(url, ["a prompt"], clients=4, per_client=1, new_tokens=2, parameters=None, processes=2)
