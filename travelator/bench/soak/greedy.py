"""Greedy answers under load against the same request alone (``--everything``).

On a batch-invariant server a request's tokens do not depend on what shares its steps, and
speculative decoding keeps greedy outputs token for token. So every greedy, one-choice answer
of the load must equal the same body sent again on the idle server, alone (a batch of one)
and with ``"speculate": false``: one comparison covers batching, chunking, preemption, prefix
hits and speculation. On a mismatch the body is sent once more with speculation as it was, so
the failure says which of the two the difference follows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx

from travelator.bench.soak.checks import Answer, Outcome
from travelator.bench.soak.config import SoakConfig, SoakResult
from travelator.bench.soak.send import exchange
from travelator.bench.soak.workload import Spec


async def compare_alone(client: httpx.AsyncClient, cfg: SoakConfig, result: SoakResult) -> None:
    """Re-send each pending greedy request alone, one at a time, and compare the answers."""
    pending, result.greedy_pending = result.greedy_pending, []
    for spec, answer in pending:
        result.greedy_compared += 1
        alone, problem = await _alone(client, cfg, spec, speculate=False)
        if alone == answer:
            result.greedy_equal += 1
            continue
        speculated, _ = await _alone(client, cfg, spec, speculate=spec.body.get("speculate", True))
        result.failures.append(
            f"greedy request {spec.index} {spec.path} {_short(spec.body)} differs from itself alone: "
            f"under load {_show(answer)}; alone without speculation {_show(alone) if alone else problem}; "
            f"alone with speculation as sent {_show(speculated) if speculated else 'failed'}")


async def _alone(client: httpx.AsyncClient, cfg: SoakConfig, spec: Spec,
                 speculate: bool) -> tuple[Answer | None, str | None]:
    again = dataclasses.replace(spec, body={**spec.body, "speculate": speculate}, disconnect=None)
    try:
        got = await asyncio.wait_for(exchange(client, again), cfg.request_timeout_s)
    except asyncio.TimeoutError:
        return None, f"no answer in {cfg.request_timeout_s} s"
    if got.outcome != Outcome.COMPLETED:
        return None, f"{got.outcome} ({got.status}): {got.problem}"
    return got.answer, None


def _show(answer: Answer) -> str:
    return f"{answer.texts[0]!r} ({answer.finishes[0]})"


def _short(body: dict) -> str:
    return json.dumps(body)[:300]
