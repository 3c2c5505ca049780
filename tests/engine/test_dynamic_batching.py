"""Dynamic batching in the serving loop: a batch waits until it is full or its first
request has waited the queue delay, and the step thread sleeps meanwhile (no busy loop)."""

from __future__ import annotations

import asyncio
import time

import pytest

from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.engine.client import RequestSpec
from travelator.sampling_params import SamplingParams

DELAY_S = 1.0


def _engine(max_num_seqs: int):
    llm = LLM("dummy:tiny", max_num_seqs=max_num_seqs, batching="dynamic", max_queue_delay_ms=DELAY_S * 1000)
    calls = {"schedule": 0}
    schedule = llm.engine.scheduler.schedule

    def counted():
        calls["schedule"] += 1
        return schedule()

    llm.engine.scheduler.schedule = counted
    return llm.engine, calls


async def _latencies(engine, num_requests: int, notified: list | None = None) -> list[float]:
    aeng = AsyncEngine(engine)
    if notified is not None:
        aeng.step_listeners.append(lambda stats, outputs: notified.append(stats))
    aeng.start()
    try:
        async def one(i: int) -> float:
            t0 = time.monotonic()
            async for out in aeng.generate(RequestSpec([5 + i, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))):
                if out.finished:
                    assert out.error is None and len(out.output_token_ids) == 3
            return time.monotonic() - t0

        return list(await asyncio.gather(*(one(i) for i in range(num_requests))))
    finally:
        aeng.stop()


def test_a_lone_request_waits_the_delay_without_spinning():
    engine, calls = _engine(max_num_seqs=4)
    notified: list = []
    (latency,) = asyncio.run(_latencies(engine, 1, notified))
    assert latency >= DELAY_S
    # A busy loop would schedule thousands of times during the delay; a sleeping one a few.
    assert calls["schedule"] < 20, calls
    assert len(notified) == engine.counters.steps == 3


def test_metrics_hear_of_each_step_once():
    """A request arriving while a batch waits wakes the loop to an empty schedule: that is not
    a step, and the metrics must not hear of the previous one again."""
    engine, _ = _engine(max_num_seqs=4)
    notified: list = []

    async def scenario():
        aeng = AsyncEngine(engine)
        aeng.step_listeners.append(lambda stats, outputs: notified.append(stats))
        aeng.start()

        async def one(i):
            async for out in aeng.generate(RequestSpec([5 + i, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))):
                pass

        try:
            await one(0)  # waits its delay, then 3 steps
            later = asyncio.create_task(one(1))
            await asyncio.sleep(DELAY_S / 3)
            await asyncio.gather(later, one(2))  # joins the waiting batch, not full: still waits
        finally:
            aeng.stop()

    asyncio.run(scenario())
    assert engine.counters.steps == 6 and len(notified) == 6


def test_an_endless_delay_is_refused():
    with pytest.raises(ValueError, match="max_queue_delay_ms"):
        LLM("dummy:tiny", batching="dynamic", max_queue_delay_ms=float("inf"))


def test_a_full_batch_starts_at_once():
    engine, _ = _engine(max_num_seqs=2)
    latencies = asyncio.run(_latencies(engine, 2))
    assert max(latencies) < DELAY_S / 2, latencies


def test_offline_generate_waits_for_the_delay_then_finishes():
    llm = LLM("dummy:tiny", max_num_seqs=8, batching="dynamic", max_queue_delay_ms=300)
    t0 = time.monotonic()
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - t0 >= 0.3
    ref = LLM("dummy:tiny").generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                      use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
