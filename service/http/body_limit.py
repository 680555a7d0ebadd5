"""413 for request bodies over the limit, in the service's error shape, before they are parsed.

Starlette's RequestBodyLimitMiddleware does the same counting but answers a declared oversize
body with its own plain-text 413, replacing any response the app sends; clients of this service
expect {"error", "error_type"} everywhere, hence this small version.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.common.errors import error_response


def too_large_message(max_bytes: int) -> str:
    return f"request body is larger than the limit of {max_bytes} bytes"


class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(status_code=413, detail=too_large_message(max_bytes))


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            # Refused on the header alone: the body is never read.
            await error_response(413, "payload_too_large", too_large_message(self.max_bytes), path=scope["path"])(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            # Chunked bodies declare no length: count as they arrive and stop at the limit.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # rendered by the HTTPException handler
            return message

        await self.app(scope, counting_receive, send)
