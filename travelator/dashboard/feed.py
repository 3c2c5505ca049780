"""The per-step records of the live view, from the step thread to any number of readers.

The step thread appends to one bounded ring and never waits on a reader: a reader that falls
further behind than the ring holds (a stalled browser) is told how many records it missed and
goes on from the oldest one kept. Each record is encoded to JSON once, by the first reader
that wants it, on the event loop, never on the step thread. The step thread wakes the event
loop only when some reader is waiting for news, and at most once until that wake has run:
readers take what came in batches, so a fast engine does not wake the loop at every step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    seq: int
    record: dict
    encoded: str | None = None


class StepFeed:
    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("the feed needs room for at least one record")
        # Names this feed in event ids, so that a reader coming back to a restarted server
        # is not resumed at a position of the old one's.
        self.instance = secrets.token_hex(4)
        self._ring: deque[_Entry] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # held for an append or a slice, never across a wait
        self._last_seq = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._news: asyncio.Event | None = None
        self.closed = False
        self._waiting = 0  # readers waiting for news (the step thread reads it without the lock)
        self._wake_scheduled = False

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Readers wait on this loop (the server's), until ``close``."""
        self._loop = loop
        self._news = asyncio.Event()
        self.closed = False
        self._wake_scheduled = False

    # ---- the step thread -------------------------------------------------------------------
    def publish(self, record: dict) -> None:
        with self._lock:
            self._last_seq += 1
            record["seq"] = self._last_seq
            self._ring.append(_Entry(self._last_seq, record))
        loop = self._loop
        if loop is not None and self._waiting and not self._wake_scheduled:
            self._wake_scheduled = True
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop has closed: the server is going away
                pass

    # ---- readers, on the event loop --------------------------------------------------------
    def close(self) -> None:
        """The server is shutting down: streams end (after what they have not sent yet)."""
        self.closed = True
        if self._news is not None:
            self._wake()

    def close_soon(self) -> None:
        """``close`` from any thread (the engine died: the server stops without draining)."""
        loop = self._loop
        if loop is None:
            self.closed = True
            return
        try:
            loop.call_soon_threadsafe(self.close)
        except RuntimeError:  # the loop has closed already
            self.closed = True

    def _wake(self) -> None:
        self._wake_scheduled = False
        news, self._news = self._news, asyncio.Event()
        news.set()

    def since(self, seq: int) -> tuple[list[tuple[int, str]], int]:
        """Records after ``seq`` still kept, encoded, and how many after it are gone already."""
        with self._lock:
            if not self._ring or self._last_seq <= seq:
                return [], 0
            first = self._ring[0].seq
            start = max(seq + 1, first)
            entries = [self._ring[i] for i in range(start - first, len(self._ring))]
        for entry in entries:
            if entry.encoded is None:
                entry.encoded = json.dumps(entry.record, separators=(",", ":"))
        return [(e.seq, e.encoded) for e in entries], start - (seq + 1)

    async def wait_after(self, seq: int, timeout_s: float) -> bool:
        """Until a record after ``seq`` is published (True) or ``timeout_s`` passes (False)."""
        self._waiting += 1  # before the check: a record published after it wakes us
        try:
            if self._last_seq > seq or self.closed:
                return self._last_seq > seq
            await asyncio.wait_for(self._news.wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            self._waiting -= 1
        return self._last_seq > seq
