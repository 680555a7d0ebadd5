"""python -m service --model-dir DIR --host H --port P --device cpu|cuda --dtype float32|bfloat16|float16

Every setting of service/settings.py is a flag (--max-batch-size 16) and a GPT2_* variable.
"""

from __future__ import annotations

import argparse
import sys

import uvicorn
from pydantic import ValidationError

from service.logs import log_config
from service.settings import Settings
from weights.checkpoint import CheckpointError


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m service", description="Serve a GPT-2 model over HTTP.")
    # Flags override GPT2_* environment variables, which override the defaults.
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:  # --cuda-graphs / --no-cuda-graphs
            parser.add_argument(flag, dest=name, default=None, help=field.description, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=name, default=None, help=field.description)
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        parser.error(str(exc))  # exits 2 with the offending setting named, no traceback


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    from service.app import create_app

    try:
        app = create_app(settings)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"cannot start: {exc}")
    # On SIGTERM uvicorn stops accepting, lets open responses finish for up to drain_seconds,
    # then runs the app's shutdown, which drains the engine loop.
    uvicorn.run(
        app, host=settings.host, port=settings.port, timeout_graceful_shutdown=settings.drain_seconds,
        log_config=log_config(settings.log_format),
    )


if __name__ == "__main__":
    main()
