"""Stored responses (``store: true``), for ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}``: in this server process's memory only, bounded in count and bytes (least
recently used out first) and expiring a fixed time after they were stored. One store per app,
used on the event loop only."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import TypeAdapter

from travelator.server.responses_protocol import InputItem, ResponseObject

_ITEMS = TypeAdapter(list[InputItem])


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[InputItem]  # what a follow-up prepends: every input item, then the output
    size: int  # bytes, as JSON
    expires_at: float


def stored(response: ResponseObject, inputs: list[InputItem], expires_at: float) -> StoredResponse:
    """``response`` kept with the conversation it ends: ``inputs`` (the items it answered,
    those of its own previous responses first), then its output items, read back as input."""
    output = _ITEMS.validate_python(response.model_dump(mode="json")["output"])
    conversation = inputs + output
    size = len(response.model_dump_json()) + len(_ITEMS.dump_json(conversation))
    return StoredResponse(response, conversation, size, expires_at)


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def keep(self, response: ResponseObject, inputs: list[InputItem]) -> None:
        """Store ``response``; older ones go when the bounds are passed (one larger than the
        whole byte bound is not kept at all)."""
        entry = stored(response, inputs, self._clock() + self.ttl_s)
        self._drop(response.id)
        self._entries[response.id] = entry
        self._bytes += entry.size
        while self._entries and (len(self._entries) > self.max_count or self._bytes > self.max_bytes):
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, unless unknown, deleted, evicted or expired."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._clock() >= entry.expires_at:
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None
