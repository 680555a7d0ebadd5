"""One error shape for every failure: {"error": message, "error_type": kind}, as TGI answers.

TGI's clients (huggingface_hub's InferenceClient) map error_type to their exception classes:
"validation" → ValidationError, "overloaded" → OverloadedError.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class ApiError(Exception):
    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = headers


def validation_error(message: str) -> ApiError:
    return ApiError(422, "validation", message)


def overloaded_error(message: str, retry_after_seconds: int) -> ApiError:
    return ApiError(429, "overloaded", message, {"Retry-After": str(retry_after_seconds)})


def error_body(error_type: str, message: str) -> dict:
    return {"error": message, "error_type": error_type}


def error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error_type, message), status_code=status, headers=headers)


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.error_type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "validation", describe_validation_errors(list(exc.errors())))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: the same shape, no internals (the log has the traceback).
        return error_response(500, "error", f"internal error ({type(exc).__name__})")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        error_type = HTTP_ERROR_TYPES.get(exc.status_code, "error")
        return error_response(exc.status_code, error_type, str(exc.detail), getattr(exc, "headers", None))
