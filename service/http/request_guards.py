"""Requests refused on their headers alone, before auth, routing or any work, in the service's
error shape: ambiguous message framing (request smuggling) and unexpected Host names (DNS
rebinding).

The Host check is Starlette's TrustedHostMiddleware (which parses IPv6 literals, "[::1]:8000");
only its plain-text refusal is replaced by the service's JSON error.
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.common.errors import error_response

# Names a browser on this machine uses for a server bound to loopback.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> str | None:
    """Bound to loopback, only loopback names: a page on another site whose name the attacker
    re-points to 127.0.0.1 (DNS rebinding) sends its own name as Host and is refused."""
    return ",".join(LOOPBACK_HOSTS) if is_loopback(bind_host) else None


class FramingMiddleware:
    """RFC 9112 §6.3: a request with both Content-Length and Transfer-Encoding may be read
    differently by a proxy in front and by this server (request smuggling); answer 400 and close
    the connection (uvicorn closes it after a response that says `Connection: close`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            if "content-length" in headers and "transfer-encoding" in headers:
                message = "a request must not carry both Content-Length and Transfer-Encoding (RFC 9112 §6.3)"
                response = error_response(400, "validation", message, {"Connection": "close"}, scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Set in the scope by the inner app TrustedHostMiddleware calls for a host it accepts.
_HOST_ACCEPTED = "gpt2.host_accepted"


async def _accept(scope: Scope, receive: Receive, send: Send) -> None:
    scope[_HOST_ACCEPTED] = True


async def _discard(message: Message) -> None:
    """TrustedHostMiddleware's own plain-text refusal: replaced by the JSON one."""


class HostAllowListMiddleware:
    """Starlette's TrustedHostMiddleware decides; a refusal is answered in the service's error shape."""

    def __init__(self, app: ASGIApp, allowed_hosts: str) -> None:
        self.app = app
        self.allowed = sorted({h.strip().lower() for h in allowed_hosts.split(",") if h.strip()})
        self.trusted = TrustedHostMiddleware(_accept, allowed_hosts=self.allowed, www_redirect=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.trusted(scope, receive, _discard)
            if not scope.pop(_HOST_ACCEPTED, False):
                given = Headers(scope=scope).get("host", "")
                message = f"Host {given!r} is not served here; allowed: {', '.join(self.allowed)}"
                await error_response(400, "validation", message, path=scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
