"""The API key check shared by the API's routes and the live view, and what counts as this
machine (a loopback address)."""

from __future__ import annotations

import ipaddress
import secrets


def bearer_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (in constant time)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address, or "localhost") is this machine only; None and names
    other than "localhost" are not."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)
