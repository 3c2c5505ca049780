"""KV cache events for cluster routers, in vLLM's wire format (``vllm/distributed/kv_events.py``).

A router that knows which blocks each engine holds can send a request where its prefix is
cached. vLLM publishes that knowledge as events, and NVIDIA Dynamo's KV router, llm-d and
``vllm-router --policy kv_aware`` consume them; travelator publishes the same ones:

- ``BlockStored``: consecutive blocks of one sequence were keyed for the prefix cache: their
  hashes, the hash of the block before them (None at a sequence's start), their token ids,
  the block size, and vLLM's ``lora_id``, ``medium`` and ``lora_name``;
- ``BlockRemoved``: keyed blocks were evicted (reused for new data);
- ``AllBlocksCleared``: every key was dropped.

Block hashes: the engine keys a block with a sha256 digest chained over every token before it.
vLLM keys its blocks the same way (sha256 by default) and, by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), sends the digest's low 64 bits as an unsigned
integer: consumers decode hashes as 64-bit integers, so travelator sends the same. Routers
index blocks by the token ids they are sent and use a hash only to name a block again when it
is removed, so any hash that is stable for the block's lifetime serves.

``medium``: vLLM says "GPU" for the engine's own KV pool and "CPU" or "DISK" for offload tiers,
which routers credit less (the KV must be fetched first). travelator's pool is the engine's
own, on whatever device it runs, so its blocks say "GPU": a hit needs no transfer.

The events of one engine step form one batch, ``[ts, events, data_parallel_rank]`` (an array:
vLLM's ``EventBatch`` is ``array_like``), msgpack-encoded. An event is a map tagged by its
``type`` (vLLM since #42892), or with ``wire_layout="array"`` a positional array led by the tag
(vLLM before it, and consumers written for it). Plain Python and msgpack: no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack

MEDIUM = "GPU"  # the engine's own KV pool (see the module docstring)


def external_block_hash(key: bytes) -> int:
    """A block key as vLLM sends it: the digest's low 64 bits, unsigned."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None

    def wire_fields(self) -> list[tuple[str, object]]:
        return [("block_hashes", self.block_hashes), ("parent_block_hash", self.parent_block_hash),
                ("token_ids", self.token_ids), ("block_size", self.block_size),
                ("lora_id", self.lora_id), ("medium", self.medium), ("lora_name", self.lora_name)]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM

    def wire_fields(self) -> list[tuple[str, object]]:
        return [("block_hashes", self.block_hashes), ("medium", self.medium)]


@dataclass(slots=True)
class AllBlocksCleared:
    def wire_fields(self) -> list[tuple[str, object]]:
        return []


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float  # seconds since the epoch
    events: list[KVCacheEvent]
    data_parallel_rank: int = 0

    def encode(self, wire_layout: str = "map") -> bytes:
        """The batch's msgpack payload, as vLLM's msgspec encoder writes it."""
        return msgpack.packb([self.ts, [_event_to_wire(e, wire_layout) for e in self.events],
                              self.data_parallel_rank])


def _event_to_wire(event: KVCacheEvent, wire_layout: str) -> dict | list:
    tag = type(event).__name__
    fields = event.wire_fields()
    if wire_layout == "array":
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **dict(fields)}


@dataclass(slots=True)
class KVEventRecorder:
    """The block manager's listener: the events since the last ``take``, in order."""

    block_size: int
    events: list[KVCacheEvent] = field(default_factory=list)

    def blocks_stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        self.events.append(BlockStored(
            [external_block_hash(k) for k in keys],
            None if parent is None else external_block_hash(parent), token_ids, self.block_size))

    def block_removed(self, key: bytes) -> None:
        # Evictions come one block at a time; consecutive ones share an event, as the
        # order of events is all a consumer needs.
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_block_hash(key))
        else:
            self.events.append(BlockRemoved([external_block_hash(key)]))

    def all_cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take_batch(self, data_parallel_rank: int = 0) -> KVEventBatch | None:
        """The events recorded since the last call as one batch (None: there were none)."""
        if not self.events:
            return None
        batch = KVEventBatch(time.time(), self.events, data_parallel_rank)
        self.events = []
        return batch
