"""Which replica stored each response (``/v1/responses`` with ``store``): each replica keeps
its own responses (server/response_store.py), so ``GET``/``DELETE /v1/responses/{id}`` and a
follow-up naming ``previous_response_id`` must reach the replica that answered the first one.

The front end reads the id from each stored answer it relays (``StoredIdReader``) and remembers
its replica (``ResponseHomes``), bounded in count, least recently used out first; an id is
forgotten when it is deleted, and all of a replica's when the replica goes down (its restarted
store is empty). An id the front end does not know goes where any request would, and the
replica's own 404 answers it, as a single server's would.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict


class ResponseHomes:
    """Response id -> the replica that stored it. Thread-safe: the front end reads and writes
    it on its event loop while the supervisor's threads report replicas down."""

    def __init__(self, max_count: int) -> None:
        self.max_count = max_count
        self._home: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, response_id: str, replica: int) -> None:
        with self._lock:
            self._home[response_id] = replica
            self._home.move_to_end(response_id)
            while len(self._home) > self.max_count:
                self._home.popitem(last=False)

    def home(self, response_id: str | None) -> int | None:
        """The replica that stored ``response_id``, or None when unknown (or ``None``)."""
        if response_id is None:
            return None
        with self._lock:
            replica = self._home.get(response_id)
            if replica is not None:
                self._home.move_to_end(response_id)
            return replica

    def forget(self, response_id: str) -> None:
        with self._lock:
            self._home.pop(response_id, None)

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica that went down lost its store: forget the ids it held."""
        if alive:
            return
        with self._lock:
            self._home = OrderedDict((i, r) for i, r in self._home.items() if r != replica)

    def __len__(self) -> int:
        return len(self._home)


class StoredIdReader:
    """Reads a relayed ``POST /v1/responses`` answer, chunk by chunk, for the id of the response
    its replica stored: a JSON response object with ``store`` true, or, on a stream, the first
    event's (``response.created``, which carries the id and ``store``). An error answer, or one
    with ``store`` false, has none."""

    def __init__(self) -> None:
        self._head = bytearray()
        self._first_event: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        if self._first_event is not None:
            return  # a stream's later events carry nothing needed here
        self._head += chunk
        if self._head.startswith((b"event:", b"data:")):
            end = self._head.find(b"\n\n")
            if end >= 0:
                self._first_event = bytes(self._head[:end])

    def stored_id(self) -> str | None:
        """The stored response's id, once the answer has been read (None if there is none)."""
        if self._first_event is not None:
            data = b"".join(line[5:] for line in self._first_event.splitlines() if line.startswith(b"data:"))
            event = json_body(data)
            response = event.get("response") if event.get("type") == "response.created" else None
        else:
            response = json_body(bytes(self._head))
        if not isinstance(response, dict) or response.get("object") != "response":
            return None
        response_id = response.get("id")
        return response_id if response.get("store") is True and isinstance(response_id, str) else None


def json_body(data: bytes) -> dict:
    """A body's JSON object ({} when it is not one): requests the proxy routes, answers it reads."""
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
