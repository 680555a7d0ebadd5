"""GET /: the playground, one page to generate from the served model and look inside it.

Its assets (service/http/playground/: index.html, app.css and ES modules; vanilla JavaScript,
no library) ship in the package and are read once: no CDN, no build step, the page works offline.
The page calls only the documented API (/info, /openapi.json, /generate_stream, /generate,
/analyze/*), sending the user's key when the server asks for one. The page itself holds no
data, so it is served without the key (service/http/auth.py), and outside the OpenAPI schema
and the request metrics: it is not part of the API.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from service.common.errors import error_response

PAGE_PATH = "/"
ASSETS_PREFIX = "/playground/"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
ASSETS = {
    entry.name: entry.read_bytes()
    for entry in (files("service.http") / "playground").iterdir()
    if any(entry.name.endswith(suffix) for suffix in MEDIA_TYPES)
}
# The page loads only its own files and calls only this origin; nothing inline, no frames.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none';"
    " form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # revalidated, so a new version of the service shows its own page
}

router = APIRouter(include_in_schema=False)
# Mounted instead when the playground is off: without it GET / would answer 405, since POST /
# (TGI's) exists.
disabled = APIRouter(include_in_schema=False)


def is_page_request(method: str, path: str) -> bool:
    return method == "GET" and (path == PAGE_PATH or path.startswith(ASSETS_PREFIX))


@router.get(PAGE_PATH)
async def page() -> Response:
    return HTMLResponse(ASSETS["index.html"], headers=HEADERS)


def media_type(name: str) -> str:
    return next(media for suffix, media in MEDIA_TYPES.items() if name.endswith(suffix))


@router.get(ASSETS_PREFIX + "{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        return error_response(404, "not_found", f"no playground file {name!r}")
    return Response(ASSETS[name], media_type=media_type(name), headers=HEADERS)


@disabled.get(PAGE_PATH)
async def no_page() -> Response:
    return error_response(404, "not_found", "the playground is off (--no-playground): this server serves the API only")
