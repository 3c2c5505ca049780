"""KV cache events in vLLM's wire format: a ZMQ subscriber (and the replay socket) rebuilds each
engine's set of cached blocks from the events alone, and it equals the block manager's own,
step after step, through shared prefixes, preemption and eviction.

The payloads are decoded here with plain msgpack and the field order of vLLM's
``vllm/distributed/kv_events.py`` (written out below), not with travelator's own classes.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time

import msgpack
import pytest
import zmq

from travelator import LLM, SamplingParams
from travelator.engine.block_manager import KVCacheManager
from travelator.config import KVEventsConfig
from travelator.engine.kv_event_publisher import ZmqEventPublisher, endpoint_for_rank
from travelator.engine.kv_events import AllBlocksCleared, KVEventBatch, KVEventRecorder
from travelator.engine.request import Request

# vLLM's event structs, their fields in declaration order (the array layout's positions).
VLLM_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BLOCK_SIZE = 4


def low64(key: bytes) -> int:
    """vLLM's maybe_convert_block_hash: the digest as a big-endian integer, low 64 bits."""
    return int.from_bytes(key, byteorder="big") & ((1 << 64) - 1)


def decode_batch(payload: bytes) -> tuple[float, list[tuple[str, dict]], int]:
    """An EventBatch (array_like: ts, events, data_parallel_rank) whose events are maps tagged
    by "type" or positional arrays led by the tag; each event as (tag, fields by name)."""
    ts, raw_events, rank = msgpack.unpackb(payload)
    events = []
    for raw in raw_events:
        if isinstance(raw, dict):
            fields = dict(raw)
            tag = fields.pop("type")
            assert set(fields) == set(VLLM_FIELDS[tag]), (tag, sorted(fields))
        else:
            tag, values = raw[0], raw[1:]
            assert len(values) == len(VLLM_FIELDS[tag]), raw
            fields = dict(zip(VLLM_FIELDS[tag], values))
        events.append((tag, fields))
    return ts, events, rank


class CacheMirror:
    """A router's view of one engine: the block hashes it holds, from the events alone."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.seen: set[int] = set()  # every hash ever stored (a parent may be evicted since)
        self.next_seq = 0
        self.counts = {tag: 0 for tag in VLLM_FIELDS}

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"batch {seq} arrived, {self.next_seq} expected"
        self.next_seq += 1
        _, events, rank = decode_batch(payload)
        assert rank == 0
        for tag, f in events:
            self.counts[tag] += 1
            if tag == "BlockStored":
                assert f["block_size"] == BLOCK_SIZE and f["medium"] == "GPU"
                assert f["lora_id"] is None and f["lora_name"] is None
                assert len(f["token_ids"]) == BLOCK_SIZE * len(f["block_hashes"])
                parent = f["parent_block_hash"]
                assert parent is None or parent in self.seen, "a parent never stored"
                assert not self.blocks & set(f["block_hashes"]), "a block stored twice"
                self.blocks |= set(f["block_hashes"])
                self.seen |= set(f["block_hashes"])
            elif tag == "BlockRemoved":
                assert f["medium"] == "GPU"
                assert set(f["block_hashes"]) <= self.blocks, "removed a block never stored"
                self.blocks -= set(f["block_hashes"])
            else:
                self.blocks.clear()


class Subscriber:
    def __init__(self, ctx: zmq.Context, pub: str, replay: str | None, topic: str = "") -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay
        self.ctx = ctx
        self.mirror = CacheMirror()

    def replay_from(self, start: int) -> list[int]:
        """Ask the replay socket for the batches from ``start`` on; apply the new ones. A
        DEALER, framed as a REQ socket frames (empty delimiter first): one request, many
        replies, which a REQ socket would drop after the first."""
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert req.poll(5000), "no answer from the replay socket"
            delimiter, seq_bytes, payload = req.recv_multipart()
            assert delimiter == b""
            if seq_bytes == END_SEQ:
                assert payload == b""
                break
            seq = int.from_bytes(seq_bytes, "big")
            got.append(seq)
            if seq >= self.mirror.next_seq:
                self.mirror.apply(seq, payload)
        req.close(linger=0)
        return got

    def receive_until(self, num_batches: int, topic: bytes = b"") -> None:
        """Apply batches until ``num_batches`` have been applied in all: live ones, and on a
        gap (or silence: a subscription takes a moment to reach the publisher) the missing
        ones from the replay socket, as vLLM's example subscriber does."""
        while self.mirror.next_seq < num_batches:
            if not self.sub.poll(200):
                self.replay_from(self.mirror.next_seq)
                continue
            got_topic, seq_bytes, payload = self.sub.recv_multipart()
            assert got_topic == topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.mirror.next_seq:
                self.replay_from(self.mirror.next_seq)
            if seq == self.mirror.next_seq:  # older ones came by replay
                self.mirror.apply(seq, payload)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_llm(**events) -> tuple[LLM, str, str]:
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", **events}
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", kernels="torch", block_size=BLOCK_SIZE,
              num_kv_blocks=24, max_num_batched_tokens=32, kv_events_config=json.dumps(config))
    return llm, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def shared_prefix_prompts() -> list[list[int]]:
    """3 system prompts of 12 tokens x 4 users of 5 tokens each."""
    systems = [[10 + 20 * s + i for i in range(12)] for s in range(3)]
    return [system + [200 + 7 * u + i for i in range(5)] for u in range(4) for system in systems]


def engine_blocks(llm: LLM) -> set[int]:
    return {low64(k) for k in llm.engine.kv.cached_keys()}


@pytest.mark.parametrize("wire_layout", ["map", "array"])
def test_a_subscriber_rebuilds_the_cached_blocks_exactly(wire_layout):
    llm, pub, replay = make_llm(wire_layout=wire_layout, topic="kv-events")
    engine = llm.engine
    ctx = zmq.Context.instance()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = shared_prefix_prompts()
    for p in prompts[:6]:
        engine.add_request(p, params)
    engine.step()
    engine.step()
    # A late subscriber: what it missed comes from the replay socket, the rest live.
    sub = Subscriber(ctx, pub, replay, topic="kv-events")
    assert sub.replay_from(0) == list(range(engine.kv_events.publisher.num_published))
    for p in prompts[6:]:
        engine.add_request(p, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        sub.receive_until(engine.kv_events.publisher.num_published, b"kv-events")
        assert sub.mirror.blocks == engine_blocks(llm), f"after step {steps}"
    assert engine.counters.preemptions > 0, "the pool was meant to be tight enough to preempt"
    assert sub.mirror.counts["BlockRemoved"] > 0, "and to evict"
    assert sub.mirror.counts["BlockStored"] > 0
    # Clearing the cache: refused while a request holds blocks, then one AllBlocksCleared.
    assert engine.reset_prefix_cache()
    sub.receive_until(engine.kv_events.publisher.num_published, b"kv-events")
    assert sub.mirror.counts["AllBlocksCleared"] == 1
    assert sub.mirror.blocks == engine_blocks(llm) == set()
    engine.shutdown()


def test_reset_is_refused_while_blocks_are_held():
    kv = KVCacheManager(8, BLOCK_SIZE, listener=(recorder := KVEventRecorder(BLOCK_SIZE)))
    r = Request("a", list(range(9)), SamplingParams(max_tokens=2), 4)
    kv.allocate_slots(r, 9)
    r.num_computed_tokens = 9
    kv.cache_full_blocks(r)
    assert not kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 2
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0
    assert [type(e).__name__ for e in recorder.events] == ["BlockStored", "AllBlocksCleared"]


def test_stored_blocks_chain_to_their_parent():
    """Hand-checked: a prompt's two full blocks are one event with no parent; a second prompt
    sharing the first block stores only its own second block, whose parent is the shared one;
    the hashes are the low 64 bits of the chained sha256 keys."""
    recorder = KVEventRecorder(BLOCK_SIZE)
    kv = KVCacheManager(8, BLOCK_SIZE, listener=recorder)

    def prefill(rid: str, tokens: list[int]) -> None:
        r = Request(rid, tokens, SamplingParams(max_tokens=2), 4)
        kv.allocate_slots(r, len(tokens), kv.find_cached_prefix(r))
        r.num_computed_tokens = len(tokens)
        kv.cache_full_blocks(r)

    prefill("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill("b", [1, 2, 3, 4, 0, 0, 0, 0, 9])
    root = hashlib.sha256(b"").digest()
    a1 = hashlib.sha256(root + msgpack_free_int64s([1, 2, 3, 4])).digest()
    a2 = hashlib.sha256(a1 + msgpack_free_int64s([5, 6, 7, 8])).digest()
    b2 = hashlib.sha256(a1 + msgpack_free_int64s([0, 0, 0, 0])).digest()
    first, second = recorder.events
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (
        [low64(a1), low64(a2)], None, [1, 2, 3, 4, 5, 6, 7, 8])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == (
        [low64(b2)], low64(a1), [0, 0, 0, 0])


def msgpack_free_int64s(tokens: list[int]) -> bytes:
    """The token bytes the engine hashes: native-endian signed 64-bit integers."""
    return b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)


def test_the_replay_buffer_keeps_the_last_batches(monkeypatch):
    """Encoding is slowed so that batches still wait in the send queue when the replay request
    comes: the answer covers every batch numbered before it was asked for."""
    encode = KVEventBatch.encode

    def slow_encode(self, layout):
        time.sleep(0.02)
        return encode(self, layout)

    monkeypatch.setattr(KVEventBatch, "encode", slow_encode)
    llm, pub, replay = make_llm(buffer_steps=3)
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for p in shared_prefix_prompts()[:8]:
        engine.add_request(p, params)
        engine.step()
    n = engine.kv_events.publisher.num_published
    assert n > 3
    sub = Subscriber(zmq.Context.instance(), pub, replay)
    sub.mirror.next_seq = n  # it has them all: only the numbers are checked
    assert sub.replay_from(0) == [n - 3, n - 2, n - 1]
    assert sub.replay_from(n - 2) == [n - 2, n - 1]
    engine.shutdown()


def test_a_data_parallel_rank_publishes_on_its_own_endpoint():
    """vLLM's offset_endpoint_port: rank r on port + r, or an inproc name suffixed _dp<r>."""
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert endpoint_for_rank("tcp://10.0.0.2:5557", 1) == "tcp://10.0.0.2:5558"
    assert endpoint_for_rank("inproc://cache", 2) == "inproc://cache_dp2"
    assert endpoint_for_rank(None, 2) is None
    # And its batches say which rank they come from.
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint="inproc://kv-events-test"), data_parallel_rank=2)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect("inproc://kv-events-test_dp2")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for _ in range(50):  # until the subscription has reached the publisher
        publisher.publish(KVEventBatch(1.5, [AllBlocksCleared()]))
        if sub.poll(100):
            break
    _, _, payload = sub.recv_multipart()
    assert msgpack.unpackb(payload) == [1.5, [{"type": "AllBlocksCleared"}], 2]
    publisher.shutdown()
    sub.close(linger=0)


def test_events_are_off_by_default_and_a_bad_config_names_its_field():
    assert LLM("dummy:tiny", device="cpu", dtype="float32", kernels="torch",
               num_kv_blocks=8).engine.kv_events is None
    with pytest.raises(ValueError, match="kv_events_config.buffer_steps"):
        LLM("dummy:tiny", kernels="torch", kv_events_config='{"buffer_steps": "many"}')


def test_disaggregation_refuses_events_it_cannot_publish_per_worker():
    from travelator.disagg.frontend import DisaggConfig, DisaggregatedFrontEnd
    from travelator.engine_args import engine_config

    config = engine_config("dummy:tiny", kv_events_config='{"enable_kv_cache_events": true}')
    with pytest.raises(ValueError, match="kv-events-config"):
        DisaggregatedFrontEnd(config, DisaggConfig(1, 1))
