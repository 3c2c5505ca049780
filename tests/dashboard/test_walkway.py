"""The live view's records (dashboard/walkway.py) against walkways traced by hand: who sits on
which seat at each step, who joins and who leaves, and why. stories260K, two seats; every
request ignores EOS, so its length alone says when it leaves (the prefill step samples its
first token)."""

from __future__ import annotations

import pytest
from paths import STORIES, needs_stories

from travelator import LLM, SamplingParams
from travelator.dashboard.feed import StepFeed
from travelator.dashboard.walkway import WalkwayRecorder

PROMPTS = {"A": "Once upon a time", "B": "The little dog ran", "C": "Lily had a red ball", "D": "One day"}


def _run(batching: str, max_tokens: dict[str, int], **engine) -> tuple[list[dict], WalkwayRecorder]:
    """Every step's record, and the recorder (its state once the engine is idle)."""
    llm = LLM(str(STORIES), dtype="float32", max_num_seqs=2, block_size=8, batching=batching, **engine)
    e = llm.engine
    recorder = WalkwayRecorder(e)
    for rid, n in max_tokens.items():
        e.add_request(PROMPTS[rid], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), request_id=rid)
    records = []
    while e.has_unfinished_requests():
        outputs = e.step()
        records.append(recorder.record(outputs))
    return records, recorder


def _seats(record: dict) -> dict[int, tuple[str, str]]:
    return {seat: (rid, kind) for seat, rid, kind, _ in record["seats"]}


@needs_stories
def test_iteration_level_walkway_by_hand():
    records, recorder = _run("iteration", {"A": 3, "B": 5, "C": 2})
    assert [_seats(r) for r in records] == [
        {0: ("A", "p"), 1: ("B", "p")},  # both prompts, first tokens sampled
        {0: ("A", "d"), 1: ("B", "d")},
        {0: ("A", "d"), 1: ("B", "d")},  # A's third token: it leaves
        {0: ("C", "p"), 1: ("B", "d")},  # C takes A's seat at the very next step
        {0: ("C", "d"), 1: ("B", "d")},  # both end here
    ]
    assert [r["joined"] for r in records] == [["A", "B"], [], [], ["C"], []]
    assert [r["left"] for r in records] == [[], [], [["A", 0, "length"]], [], [["B", 1, "length"], ["C", 0, "length"]]]
    assert [r["waiting"] for r in records] == [1, 1, 1, 0, 0]
    assert records[0]["queue"][0][0] == "C"
    prompt_a = len(recorder.engine.tokenizer.encode(PROMPTS["A"]))
    # [prompt tokens, output tokens, state, priority, KV blocks] for the hover.
    assert records[0]["requests"]["A"] == [prompt_a, 1, "running", 0, -(-prompt_a // 8)]
    assert [f[0] for r in records for f in r["finished"]] == ["A", "B", "C"]
    assert all(f[1] is not None and f[1] > 0 and f[4] in (2, 3, 5) for r in records for f in r["finished"])
    assert records[-1]["admitted_total"] == 3 and recorder.seats == {}
    assert records[-1]["kv"]["used"] == 0


@needs_stories
def test_static_batching_leaves_seats_empty_until_the_batch_ends():
    records, _ = _run("static", {"A": 3, "B": 5, "C": 2})
    assert [_seats(r) for r in records] == [
        {0: ("A", "p"), 1: ("B", "p")},
        {0: ("A", "d"), 1: ("B", "d")},
        {0: ("A", "d"), 1: ("B", "d")},
        {1: ("B", "d")},  # A's seat stays empty: C waits for the whole batch
        {1: ("B", "d")},
        {0: ("C", "p")},
        {0: ("C", "d")},
    ]
    assert [r["waiting"] for r in records] == [1, 1, 1, 1, 1, 0, 0]


@needs_stories
def test_a_one_step_request_is_drawn_joining_and_leaving():
    records, _ = _run("iteration", {"D": 1})
    assert len(records) == 1
    assert _seats(records[0]) == {0: ("D", "p")}
    assert records[0]["joined"] == ["D"] and records[0]["left"] == [["D", 0, "length"]]


@needs_stories
def test_preemption_frees_the_seat_and_the_request_comes_back():
    # 6 blocks of 8 tokens: two requests of ~5 + 30 tokens cannot both stay (5 blocks each).
    records, _ = _run("iteration", {"A": 30, "B": 30}, num_kv_blocks=6)
    out = [i for i, r in enumerate(records) if ["B", 1, "preempted"] in r["left"]]
    assert out, "B was never preempted"
    back = [i for i, r in enumerate(records) if "B" in r["joined"]]
    assert back[0] == 0 and len(back) >= 2 and back[1] > out[0]
    assert "B" not in {rid for r in records[out[0]:back[1]] for _, rid, _, _ in r["seats"]}
    assert records[-1]["preemptions_total"] >= 1 and records[-1]["admitted_total"] == 2
    for r in records:  # never two requests on one seat, never past the seats there are
        seats = [s for s, *_ in r["seats"]]
        assert len(seats) == len(set(seats)) and all(0 <= s < 2 for s in seats)


def test_feed_is_bounded_and_tells_a_slow_reader_what_it_missed():
    feed = StepFeed(capacity=4)
    for i in range(10):
        feed.publish({"i": i})  # no loop bound, no reader: never waits
    records, dropped = feed.since(0)
    assert [seq for seq, _ in records] == [7, 8, 9, 10] and dropped == 6
    assert records[0][1] == '{"i":6,"seq":7}'
    assert feed.since(8) == ([(9, '{"i":8,"seq":9}'), (10, '{"i":9,"seq":10}')], 0)
    assert feed.since(10) == ([], 0)
    with pytest.raises(ValueError):
        StepFeed(capacity=0)
