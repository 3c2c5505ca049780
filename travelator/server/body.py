"""Request bodies, read with a bound (413 past it) before anything else looks at them: the API's
JSON bodies and the live view's login form alike."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.requests import ClientDisconnect

from travelator.server.errors import APIError, from_validation_error
from travelator.server.preprocess import Preprocessor

M = TypeVar("M", bound=BaseModel)


async def read_bounded(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to pass ``limit`` bytes (from its
    Content-Length, or while it arrives): no more than ``limit`` bytes are ever held."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is {length} bytes, more than the limit of {limit}",
                       code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is more than the limit of {limit} bytes",
                               code="request_too_large")
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return bytes(body)


async def read_body(request: Request, model: type[M], limit: int, preprocessor: Preprocessor) -> M:
    """Read at most ``limit`` bytes (413 past it) and validate them as ``model`` (400 if bad), on
    a preprocessing worker (megabytes of token ids take a while).

    The body is parsed here rather than by FastAPI so that any content type is read as JSON
    (``curl -d`` sends form encoding by default) and every failure has the OpenAI error shape.
    """
    body = await read_bounded(request, limit)
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    return await preprocessor.run(_validate, model, body)


def _validate(model: type[M], body: bytes) -> M:
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    _refuse_nan_and_infinity(body)
    return req


def _refuse_nan_and_infinity(body: bytes) -> None:
    """NaN and Infinity are not JSON, though the parser takes them. A float field refuses them
    by name (protocol.py); anywhere else (a schema, template variables, an ignored field) they
    make the whole body invalid."""
    if b"NaN" not in body and b"Infinity" not in body:  # most bodies: no second parse
        return
    try:
        from_json(body, allow_inf_nan=False)
    except ValueError as exc:  # the body parsed with them, so they are what fails
        raise APIError(400, f"the request body is not valid JSON: {exc} (NaN and Infinity are not "
                            f"JSON numbers)", code="invalid_json") from None
