"""X-Request-Id: taken from the request (or made), echoed on the response, carried into logs.

A pure ASGI middleware, outermost, so every answer carries the id (401, 413 and 429 included)
and every log line written while the request is handled can name it: the id lives in a
context variable that service/http/logs.py's filter reads.
"""

from __future__ import annotations

import contextvars
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# Printable ASCII without spaces, bounded: an id is echoed into headers and logs as it is.
VALID_ID = re.compile(r"[!-~]{1,200}")

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER.encode()), None)
        rid = given if given is not None and VALID_ID.fullmatch(given) else uuid.uuid4().hex
        token = request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                message = {**message, "headers": headers + [(HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)
