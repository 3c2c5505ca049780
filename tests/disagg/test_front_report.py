"""The front end's counters add up its workers' (what /metrics shows under --disaggregate)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from travelator.disagg import messages as m
from travelator.disagg.front_report import _counters
from travelator.engine.client import EngineCounters


def test_counters_add_up_the_workers_speculation_included():
    def worker(**kw) -> SimpleNamespace:
        return SimpleNamespace(counters=dataclasses.asdict(EngineCounters(**kw)))

    front = SimpleNamespace(router=SimpleNamespace(finished={"stop": 3}), stats={
        m.WorkerId(m.PREFILL, 0): worker(prompt_tokens=10, steps=4, preemptions=1),
        m.WorkerId(m.DECODE, 0): worker(prompt_tokens=10, generation_tokens=7, steps=5, draft_tokens=8,
                                        accepted_draft_tokens=3, speculative_steps=2),
        m.WorkerId(m.DECODE, 1): worker(generation_tokens=2, steps=1, draft_tokens=4, accepted_draft_tokens=1,
                                        speculative_steps=1, preemptions=2),
    })
    c = _counters(front)
    assert c.finished == {"stop": 3}
    assert (c.prompt_tokens, c.generation_tokens, c.steps, c.preemptions) == (10, 9, 10, 3)
    assert (c.draft_tokens, c.accepted_draft_tokens, c.speculative_steps) == (12, 4, 3)
