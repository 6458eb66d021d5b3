"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}``, and the handlers
that turn every failure at the edge into one of them (never a bare 500 or 422)."""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error answered with the OpenAI body; ``param`` names the offending field."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status_code, self.message, self.param, self.code)


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    error_type = ERROR_TYPES.get(status_code, "internal_server_error")
    return {
        "error": {
            "message": message,
            "type": error_type,
            "param": param,
            "code": code if code is not None else status_code,
        }
    }


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def sse_error(message: str, status_code: int = 500) -> str:
    """The event that ends a stream that failed after its headers were sent."""
    return f"data: {json.dumps(error_body(status_code, message))}\n\n"


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(OpenAIError(400, "malformed JSON in the request body"))
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
        return error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        return error_response(OpenAIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Anything nobody turned into an OpenAIError (a replica lost mid-call, a bug) still
        # gets the OpenAI body; only the exception's type leaves the server.
        return error_response(OpenAIError(500, f"internal error ({type(exc).__name__})"))
