#!/usr/bin/env python3
"""Docker HEALTHCHECK: exit 0 when the server in this container answers 200 on /health.

Python's standard library, not curl: the slim CPU image has no curl.
"""

import os
import sys
import urllib.request

HEALTH_PATH = "/health"


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('GPT2_PORT', '8000')}{HEALTH_PATH}"
    try:
        # urlopen raises for any non-2xx status and for a refused or timed-out connection.
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read()
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
