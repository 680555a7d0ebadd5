"""Optional bearer-token auth: every route but the probes, the metrics scrape and the playground page needs the key."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from service.common.errors import error_response
from service.http.routes_playground import is_page_request

# Load balancers and Prometheus cannot be given a secret everywhere; these reveal nothing.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The playground page holds no data, and a browser must load it before it can ask for the key.
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or is_page_request(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        # RFC 9110 §11.1: the scheme name is case-insensitive ("bearer" is "Bearer").
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # Constant-time comparison: the key must not leak through response timing.
        valid = hmac.compare_digest(token.strip().encode(), self.expected)
        if not (valid and scheme.lower() == "bearer"):
            response = error_response(
                401, "authentication", "missing or wrong bearer token (header `Authorization: Bearer <api_key>`)",
                {"WWW-Authenticate": "Bearer"}, scope["path"],
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
