"""The API key check shared by the API's routes and the live view."""

from __future__ import annotations

import secrets


def bearer_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (in constant time)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())
