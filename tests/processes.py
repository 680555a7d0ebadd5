"""Helpers for tests that start real processes (servers, Prometheus) on loopback."""

from __future__ import annotations

import os
import socket

STARTUP_TIMEOUT_S = 120  # a busy shared CPU can take long to import torch; never hang past this


def clean_env() -> dict[str, str]:
    # The test's own GPT2_* settings must not leak into the server it starts.
    return {k: v for k, v in os.environ.items() if not k.startswith("GPT2_")}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
