"""OpenAI-style error bodies for every failure: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from travelator.server.protocol import ErrorInfo, ErrorResponse
from travelator.server.responses_protocol import ITEM_TAGS

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered as ``status`` with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A pydantic error as a 400 (OpenAI answers bad fields with 400, not FastAPI's 422)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error") or first.get("msg", "")
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    params = [_param(e) for e in errors]
    param = params[0]
    msg = first.get("msg", "invalid value")
    tops = {p.split(".", 1)[0] if p else None for p in params}
    if len(errors) > 1 and len(tops) == 1 and param is not None:
        # One field failed every member of a union: say what the union takes.
        common = os.path.commonprefix([p.split(".") for p in params])
        param = ".".join(common) or param
        key = next((c for c in reversed(common) if not c.isdigit()), None)
        msg = _UNION_HINTS.get(key, msg)
        more = ""
    else:
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{msg}{more}", param=param, code="invalid_value")


_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "expected a string or a list of strings",
    "content": "expected a string or a list of content parts",
    "messages": "expected a list of messages, each an object with a role and a content",
    "tools": "expected a list of function tools; other tool types are not supported",
}


def _param(error: dict) -> str | None:
    # Union members show up as extra path parts ("prompt.str", "prompt.list[int]"); keep the field.
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(p for p in loc if not _is_type_name(p)) or None


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict"} or part in ITEM_TAGS or "[" in part or part.startswith(
        ("function-", "constrained-", "literal[", "tagged-union"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
