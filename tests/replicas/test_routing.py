"""The replicas' pure parts: core shares, prefix routing, the replicas' arguments and where
stored responses live, against hand-computed answers."""

from __future__ import annotations

import json

import pytest

from travelator.replicas.cores import core_shares, parse_cpu_list
from travelator.replicas.proxy import json_body, routing_text
from travelator.replicas.response_homes import ResponseHomes, StoredIdReader
from travelator.replicas.launch import replica_serve_args
from travelator.replicas.routing import NoReplicaAlive, PrefixRouter

SYSTEM_A = "You are a terse assistant who answers in one sentence about the sea. " * 2
SYSTEM_B = "You are a patient tutor who explains arithmetic to children, step by step. " * 2


def test_cpu_list_format():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_cores_cut_into_contiguous_runs():
    assert core_shares(2, cpus=[0, 1, 2, 3], domains=[[0, 1, 2, 3]]) == [{0, 1}, {2, 3}]
    assert core_shares(3, cpus=[0, 1, 2, 3, 4], domains=[[0, 1, 2, 3, 4]]) == [{0, 1}, {2, 3}, {4}]
    # Three cache domains do not divide among two replicas: cut by position instead.
    assert core_shares(2, cpus=[0, 1, 2], domains=[[0], [1], [2]]) == [{0, 1}, {2}]


def test_cores_follow_cache_domains():
    domains = [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    cpus = sorted(c for d in domains for c in d)
    assert core_shares(2, cpus=cpus, domains=domains) == [{0, 1, 8, 9, 2, 3, 10, 11},
                                                          {4, 5, 12, 13, 6, 7, 14, 15}]
    assert core_shares(4, cpus=cpus, domains=domains) == [set(d) for d in domains]


def test_more_replicas_than_cores_is_refused():
    with pytest.raises(ValueError, match="--data-parallel-size 3 needs a core per replica"):
        core_shares(3, cpus=[0, 1])


def test_a_shared_prefix_goes_where_it_went_before():
    router = PrefixRouter(2, block_chars=64)
    first = router.choose(SYSTEM_A + "Why is it blue?")
    assert (first.replica, first.reason) == (0, "least_loaded")
    other = router.choose(SYSTEM_B + "What is 7 times 8?")
    assert (other.replica, other.reason) == (1, "least_loaded")  # replica 0 has one in flight
    again = router.choose(SYSTEM_A + "How deep is it?")
    # Replica 0 holds 1 request and replica 1 holds 1: the prefix decides. SYSTEM_A is 138
    # characters, so two whole 64-character blocks are shared.
    assert (again.replica, again.reason, again.matched_chars) == (0, "prefix", 128)
    assert router.in_flight == [2, 1]


def test_an_overloaded_prefix_replica_is_passed_over():
    router = PrefixRouter(2, block_chars=64, overload_margin=2)
    router.choose(SYSTEM_A + "one")
    for _ in range(2):
        assert router.choose(SYSTEM_A + "more").reason == "prefix"
    assert router.in_flight == [3, 0]  # 3 > 0 + 2
    spill = router.choose(SYSTEM_A + "yet more")
    assert (spill.replica, spill.reason) == (1, "prefix_overloaded")
    for _ in range(3):
        router.done(0)
    assert router.choose(SYSTEM_A + "later").replica == 1  # the prefix went to 1 last


def test_a_dead_replicas_prefixes_are_forgotten():
    router = PrefixRouter(2, block_chars=64)
    router.choose(SYSTEM_A)
    router.done(0)
    router.set_alive(0, False)
    decision = router.choose(SYSTEM_A)
    assert (decision.replica, decision.reason) == (1, "least_loaded")
    router.set_alive(1, False)
    with pytest.raises(NoReplicaAlive):
        router.choose(SYSTEM_A)


def test_a_prompt_shorter_than_a_block_has_no_prefix():
    router = PrefixRouter(2, block_chars=64)
    assert router.choose("short").reason == "least_loaded"
    assert router.choose("short").reason == "least_loaded"


def _text(req) -> str:
    return routing_text(json_body(json.dumps(req).encode()))


def test_routing_text_of_each_request_shape():
    assert _text({"prompt": "abc"}) == "abc"
    assert _text({"prompt": ["abc", "def"]}) == "abc"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert _text({"messages": messages}) == json.dumps(messages)
    assert _text({"instructions": "I", "input": "x"}) == "Ix"
    assert _text({"query": "q", "documents": ["d"]}) == "q"  # rerank: the query leads
    assert _text({"text_1": ["q1", "q2"], "text_2": ["d1", "d2"]}) == "q1"  # score
    assert routing_text(json_body(b"not json")) == routing_text(json_body(b"[1]")) == ""


def test_a_follow_up_goes_to_the_replica_holding_its_response():
    router = PrefixRouter(2, block_chars=64, overload_margin=0)
    router.choose(SYSTEM_B)
    for text in ("a", "b"):
        router.choose(text)
    assert router.in_flight == [2, 1]
    # Replica 0 is the busier one and SYSTEM_B's prefix lives there: without a home this is
    # prefix_overloaded, to replica 1.
    follow = router.choose(SYSTEM_B, home=0)
    assert (follow.replica, follow.reason) == (0, "previous_response")
    assert router.in_flight == [3, 1]
    router.set_alive(0, False)  # its store is gone: the follow-up is routed as any request
    assert router.choose(SYSTEM_A, home=0).reason == "least_loaded"


def test_response_homes_bounded_forgotten_on_delete_and_restart():
    homes = ResponseHomes(max_count=3)
    for i, replica in enumerate([0, 1, 0]):
        homes.remember(f"resp_{i}", replica)
    assert homes.home("resp_0") == 0  # now the most recently used
    homes.remember("resp_3", 1)  # the fourth: resp_1, least recently used, goes
    assert [homes.home(f"resp_{i}") for i in range(4)] == [0, None, 0, 1]
    homes.forget("resp_2")
    assert homes.home("resp_2") is None and homes.home(None) is None
    homes.set_alive(1, True)
    assert homes.home("resp_3") == 1
    homes.set_alive(1, False)
    assert homes.home("resp_3") is None and homes.home("resp_0") == 0 and len(homes) == 1


def _read(chunks: list[bytes]) -> str | None:
    reader = StoredIdReader()
    for chunk in chunks:
        reader.feed(chunk)
    return reader.stored_id()


def test_stored_id_read_from_json_and_stream_answers():
    stored = json.dumps({"id": "resp_1", "object": "response", "store": True, "output": []}).encode()
    assert _read([stored[:7], stored[7:]]) == "resp_1"
    assert _read([stored.replace(b'"store": true', b'"store": false')]) is None
    assert _read([json.dumps({"error": {"code": "not_found"}}).encode()]) is None
    created = {"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_2", "object": "response", "store": True}}
    event = f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
    later = b'event: response.output_text.delta\ndata: {"type": "x", "delta": "{"}\n\n'
    assert _read([event[:20], event[20:] + later[:9], later[9:]]) == "resp_2"
    assert _read([b'data: {"error": {"code": "replica_failed"}}\n\n']) is None


def test_front_end_flags_are_not_passed_on():
    argv = ["--model", "m.gguf", "--data-parallel-size", "2", "--host=0.0.0.0", "--port", "9000",
            "--api-key", "k"]
    assert replica_serve_args(argv) == ["--model", "m.gguf", "--api-key", "k"]
