"""Why a request is refused, as types: a server answers them without reading the message."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses. ``param`` names the field at fault: a ``SamplingParams``
    field, or ``"prompt"``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt (``param="prompt"``), or the prompt plus ``max_tokens``
    (``param="max_tokens"``), does not fit the context."""
