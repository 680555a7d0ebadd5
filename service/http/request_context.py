"""X-Request-Id: taken from the request (or made), echoed on the response, carried into logs.

asgi-correlation-id's middleware, outermost, so every answer carries the id (401, 413 and 429
included) and every log line written while the request is handled can name it: the id lives in
its context variable, which service/http/logs.py's filter reads.
"""

from __future__ import annotations

import re
import uuid

HEADER = "x-request-id"
# Printable ASCII without spaces, bounded: an id is echoed into headers and logs as it is.
VALID_ID = re.compile(r"[!-~]{1,200}")


def is_valid_id(given: str) -> bool:
    return VALID_ID.fullmatch(given) is not None


def new_id() -> str:
    return uuid.uuid4().hex


# Keyword arguments for app.add_middleware(CorrelationIdMiddleware, **REQUEST_ID_OPTIONS): an id
# that is not printable ASCII, or too long, is replaced by a new one (and a warning logged).
REQUEST_ID_OPTIONS = {"header_name": "X-Request-Id", "validator": is_valid_id, "generator": new_id}
