"""Error answers in the shape each API's clients read.

Everywhere but /v1: {"error": message, "error_type": kind}, as TGI answers; its clients
(huggingface_hub's InferenceClient) map error_type to their exception classes: "validation" →
ValidationError, "overloaded" → OverloadedError.
Under /v1 (OpenAI's routes): OpenAI's {"error": {"message", "type", "param", "code"}}, the kind
as its `code`; the `openai` client and those built on it (langchain, instructor, litellm) read
the message from there.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class ApiError(Exception):
    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = headers
        self.param = param  # the request field at fault, where one is (OpenAI's `param`)


def validation_error(message: str) -> ApiError:
    return ApiError(422, "validation", message)


def overloaded_error(message: str, retry_after_seconds: int) -> ApiError:
    return ApiError(429, "overloaded", message, {"Retry-After": str(retry_after_seconds)})


OPENAI_PREFIX = "/v1/"
# OpenAI's error `type` for each status this service answers with.
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def openai_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return OPENAI_TYPES.get(status, "invalid_request_error")


def error_body(error_type: str, message: str, path: str | None = None, status: int = 400, param: str | None = None) -> dict:
    """TGI's shape, or OpenAI's for a path under /v1/ (in a stream: the status it would have had)."""
    if path is not None and path.startswith(OPENAI_PREFIX):
        return {"error": {"message": message, "type": openai_type(status), "param": param, "code": error_type}}
    return {"error": message, "error_type": error_type}


def error_response(
    status: int, error_type: str, message: str, headers: dict[str, str] | None = None, path: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(error_type, message, path, status, param), status_code=status, headers=headers)


def describe_validation_errors(errors: list[dict]) -> str:
    """Pydantic's error list as one readable line: `parameters.top_p: Input should be ...; ...`."""
    parts = []
    for err in errors:
        # FastAPI prefixes the location with where it came from ("body", "query").
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
        where = ".".join(loc)
        # Our own validators' messages come prefixed by pydantic; the prefix says nothing.
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "invalid request"


# Status codes starlette raises by itself, with the error_type a client should see.
HTTP_ERROR_TYPES = {
    400: "validation",
    401: "authentication",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "validation",
}


def first_field(errors: list[dict]) -> str | None:
    """The field of pydantic's first error, as OpenAI's `param` names it (`messages.0.content`)."""
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
        if loc:
            return ".".join(loc)
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.error_type, exc.message, exc.headers, request.url.path, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return error_response(422, "validation", describe_validation_errors(errors), path=request.url.path,
                              param=first_field(errors))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: the same shape, no internals (the log has the traceback).
        return error_response(500, "error", f"internal error ({type(exc).__name__})", path=request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404 and exc.detail == "Not Found":
            # The router's own 404: no route matched. Said so, so that no client reads it as a
            # model or an adapter not being served.
            message = f"no route {request.method} {path} on this server (its routes are listed at /docs)"
            return error_response(404, "route_not_found", message, path=path)
        error_type = HTTP_ERROR_TYPES.get(exc.status_code, "error")
        return error_response(exc.status_code, error_type, str(exc.detail), getattr(exc, "headers", None), path)
