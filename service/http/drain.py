"""After SIGTERM: new requests are answered 503 (docs/api.md's promise) while in-flight ones finish.

The server (service/http/server.py) keeps listening during the drain and calls `Drain.begin`;
this middleware answers every request that arrives afterwards. /metrics still answers, so the
last scrape sees the final counts; /health says 503, so load balancers stop sending traffic.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from service.common.errors import error_response

STILL_SERVED = frozenset({"/metrics"})


class Drain:
    def __init__(self) -> None:
        self.active = False
        self._listeners: list[Callable[[], None]] = []

    def on_begin(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def begin(self) -> None:
        if self.active:
            return
        self.active = True
        for listener in self._listeners:
            listener()


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain, retry_after_seconds: int) -> None:
        self.app = app
        self.drain = drain
        self.retry_after = str(retry_after_seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.drain.active and scope["type"] == "http" and scope["path"] not in STILL_SERVED:
            response = error_response(
                503, "overloaded", "the server is shutting down; retry on another replica",
                {"Retry-After": self.retry_after, "Connection": "close"}, scope["path"],
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
