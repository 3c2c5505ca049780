"""The ZMQ side of KV events, as vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``).

Each batch goes out on a PUB socket as one multipart message: the topic, an 8-byte big-endian
sequence number (0, 1, 2, ... per publisher) and the msgpack payload. A subscriber that sees a
gap in the numbers asks the ROUTER replay socket for the batches from a number on: it sends
that number (8 bytes, big-endian) in a REQ-style message and gets each buffered batch from
there as ``(seq, payload)``, then the end marker ``(-1 as 8 signed bytes, b"")``. The last
``buffer_steps`` batches are kept for this.

The step thread only numbers a batch and queues it (never blocks: a full queue drops the
batch, which its subscribers see as a gap that replay cannot fill, and it is logged); one
thread owns the sockets (a ZMQ socket is not thread-safe), encodes, sends and answers replays.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from travelator.config import KVEventsConfig
from travelator.engine.kv_events import KVEventBatch, KVEventRecorder

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how often the sending thread looks at the replay socket when idle


def endpoint_for_rank(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule for data-parallel ranks: rank r publishes on the TCP port + r, or on an
    inproc endpoint suffixed ``_dp<r>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"kv_events_config.endpoint: cannot offset {endpoint!r} by a rank (tcp or inproc)")


def _binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard or local endpoint is bound, any other connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0  # batches lost to a full queue
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_published = 0  # batches numbered so far: the next one's sequence number
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = endpoint_for_rank(config.endpoint, data_parallel_rank)
        (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(endpoint_for_rank(config.replay_endpoint, data_parallel_rank))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Number the batch and hand it to the sending thread (the step thread's part)."""
        batch.data_parallel_rank = self.data_parallel_rank
        seq = self.num_published
        self.num_published += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            logger.error("KV events: the send queue is full; batch %d dropped", seq)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the sending thread --------------------------------------------------------
    def _run(self) -> None:
        alive = True
        while alive:
            alive = self._send_queued(wait_s=_POLL_S, at_most=max(1, self._queue.qsize()))
            if self._replay is not None and self._replay.poll(0):
                # What the step thread queued before the request came is sent first (no more:
                # a busy engine would keep it waiting), so a replay answers every batch
                # numbered before it was asked for.
                alive = alive and self._send_queued(wait_s=0.0, at_most=self._queue.qsize())
                self._answer_replay()

    def _send_queued(self, wait_s: float, at_most: int) -> bool:
        """Send up to ``at_most`` queued batches (so that replay requests are looked at between
        them), waiting up to ``wait_s`` for the first; False once the shutdown mark is taken."""
        topic = self.config.topic.encode()
        sent = 0
        while sent < at_most:
            try:
                item = self._queue.get(timeout=wait_s) if sent == 0 and wait_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            seq, batch = item
            payload = batch.encode(self.config.wire_layout)
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            sent += 1
        return True

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # identity, empty delimiter, start sequence number
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


class KVEventStream:
    """An engine's events: the block manager's listener, published as one batch per step."""

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0) -> None:
        self.recorder = KVEventRecorder(block_size)
        self.publisher = ZmqEventPublisher(config, data_parallel_rank)

    def flush(self) -> None:
        """Publish the events since the last flush, if any (the end of a step)."""
        if (batch := self.recorder.take_batch()) is not None:
            self.publisher.publish(batch)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()
