"""What starting an HTTP process takes: its settings from the flags, then `run`. `python -m service`
(service/__main__.py) runs one itself, or with --api-servers N becomes the supervisor
(service/workers.py) of N HTTP processes that each start here.

Every setting of service/settings.py is a flag (--max-batch-size 16) and a GPT2_* variable.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
from pydantic import ValidationError
from pydantic_settings import CliApp, CliSettingsSource

from service.http.core_link import CoreLink
from service.http.request_guards import default_allowed_hosts
from service.settings import Settings
from weights.checkpoint import CheckpointError


def parse_settings(argv: list[str] | None = None) -> Settings:
    """pydantic-settings' CLI source: a kebab-case flag per setting, booleans as --x / --no-x.
    Flags override GPT2_* environment variables, which override the defaults."""
    source = CliSettingsSource(
        Settings, cli_prog_name="python -m service", cli_kebab_case=True, cli_implicit_flags=True,
        cli_avoid_json=True, cli_hide_none_type=True,
    )
    try:
        return CliApp.run(Settings, cli_args=sys.argv[1:] if argv is None else argv, cli_settings_source=source)
    except ValidationError as exc:
        source.root_parser.error(str(exc))  # exits 2 with the offending setting named, no traceback


def serving_settings(argv: list[str] | None = None) -> Settings:
    settings = parse_settings(argv)
    if settings.allowed_hosts is None:
        # Decided here, where the socket is bound; in-process apps (tests) take any Host.
        settings = settings.model_copy(update={"allowed_hosts": default_allowed_hosts(settings.host)})
    if settings.device == "cuda" and not cuda_device_seen():
        sys.exit(f"cannot start: --device cuda, but this torch ({torch.__version__}) sees no CUDA device")
    return settings


def cuda_device_seen() -> bool:
    """Whether torch sees a CUDA device, asked of NVML rather than CUDA: this process serves HTTP
    and never initialises CUDA (the engine core and the analysis process hold the device), and
    torch's default check initialises the driver. The processes it spawns inherit the setting,
    harmlessly: they initialise CUDA when they load the model."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    return torch.cuda.is_available()


def run(settings: Settings, link: CoreLink | None = None) -> None:
    """Serve in this process: alone, or as one of several HTTP processes (`link`)."""
    from service.app import create_app
    from service.http.server import serve

    try:
        app = create_app(settings, link)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"cannot start: {exc}")
    # On SIGTERM: new requests get 503 while open responses finish (up to drain_seconds); the
    # engine core drains alongside and cancels what is left just before that deadline.
    serve(app, settings, None if link is None else listening_socket(settings.host, settings.port))


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound, not yet listening (uvicorn listens): one of several on this port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
