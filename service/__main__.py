"""python -m service --model-dir DIR --host H --port P --device cpu|cuda --dtype float32|bfloat16|float16

Every setting of service/settings.py is a flag (--max-batch-size 16) and a GPT2_* variable.
Serves in this process (service/launch.py), or with --api-servers N supervises N HTTP processes
in front of one engine core (service/workers.py).
"""

from __future__ import annotations

import sys

from service.launch import run, serving_settings


def main(argv: list[str] | None = None) -> None:
    settings = serving_settings(argv)
    if settings.api_server_count > 1:
        from service.workers import supervise

        sys.exit(supervise(settings, sys.argv[1:] if argv is None else argv))
    run(settings)


if __name__ == "__main__":
    main()
