"""One soak request: send it, cut it short as its spec says, judge the answer, count it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import NamedTuple

import httpx

from travelator.bench.soak.checks import Answer, Outcome, judge_error, validate_json, validate_stream
from travelator.bench.soak.config import SoakConfig, SoakResult
from travelator.bench.soak.workload import Spec


class Exchange(NamedTuple):
    outcome: str
    problem: str | None
    status: int | str
    answer: Answer | None = None  # of a completed request


async def send(client: httpx.AsyncClient, spec: Spec, cfg: SoakConfig, result: SoakResult) -> str:
    t0 = time.monotonic()
    outcome, problem, status, answer = await _send_inner(client, spec, cfg)
    elapsed = time.monotonic() - t0
    if "priority" in spec.body and not spec.invalid:
        result.priorities[spec.body["priority"]] += 1
    result.statuses[status] += 1
    if outcome == Outcome.FAILED and _failed_with(result.killed_worker, problem):
        result.killed += 1  # it was on the worker the soak killed: its error is the expected one
        result.killed_choices += spec.choices
        return Outcome.KILLED
    if isinstance(status, int) and status >= 500 and status != 503:
        result.server_errors_5xx += 1
    if outcome == Outcome.COMPLETED:
        result.completed += 1
        result.latencies.append(elapsed)
        if spec.constraint is not None:
            _check_constrained(spec, answer, result)
        if cfg.everything and spec.greedy:
            result.greedy_pending.append((spec, answer))
    elif outcome == Outcome.DISCONNECTED:
        result.disconnected += 1
    elif outcome == Outcome.REJECTED:
        result.rejected_503 += 1
    elif outcome == Outcome.INVALID:
        result.invalid_4xx += 1
    else:
        body = json.dumps(spec.body)[:300]
        result.failures.append(f"request {spec.index} {spec.path} {body}: status {status}: {problem}")
    return outcome


def _check_constrained(spec: Spec, answer: Answer, result: SoakResult) -> None:
    """Every finished constrained choice must satisfy its constraint; one cut by max_tokens is
    counted apart (its grammar is incomplete by design)."""
    for i, (text, finish) in enumerate(zip(answer.texts, answer.finishes)):
        if finish == "length":
            result.constrained_cut += 1
            continue
        result.constrained_checked += 1
        problem = spec.constraint.check(text)
        if problem:
            result.failures.append(f"request {spec.index} choice {i}: constrained answer invalid: {problem}")
        else:
            result.constrained_valid += 1


def _failed_with(killed_worker: str | None, problem: str | None) -> bool:
    """The error names the decode worker the soak killed: the request was on it when it died,
    or its KV was on the way there from a prefill worker and the transfer broke off."""
    if not killed_worker or not problem:
        return False
    return f"{killed_worker} died" in problem or f"KV transfer to {killed_worker} failed" in problem


async def _send_inner(client: httpx.AsyncClient, spec: Spec, cfg: SoakConfig) -> Exchange:
    """One request, cut short as the spec says."""
    if spec.disconnect in ("early", "wait"):
        task = asyncio.ensure_future(exchange(client, spec))
        done, _ = await asyncio.wait({task}, timeout=spec.disconnect_after)
        if not done:
            task.cancel()  # the connection is dropped: the server sees the client go
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return Exchange(Outcome.DISCONNECTED, None, "cut")
        return task.result()
    try:
        return await asyncio.wait_for(exchange(client, spec), cfg.request_timeout_s)
    except asyncio.TimeoutError:
        return Exchange(Outcome.FAILED, f"no answer in {cfg.request_timeout_s} s (a hang)", "timeout")


async def exchange(client: httpx.AsyncClient, spec: Spec) -> Exchange:
    """Send ``spec``, read and judge the answer (leaving mid-stream if the spec says so)."""
    try:
        async with client.stream("POST", spec.path, json=spec.body) as r:
            status = r.status_code
            if status != 200:
                raw = await r.aread()
                return Exchange(*judge_error(spec, status, raw))
            if not spec.stream:
                raw = await r.aread()
                try:
                    data = json.loads(raw)
                except json.JSONDecodeError:
                    return Exchange(Outcome.FAILED, f"not JSON: {raw[:200]!r}", status)
                if spec.invalid:
                    return Exchange(Outcome.FAILED, "an invalid request was answered 200", status)
                return _judged(*validate_json(spec, data), status)
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                return Exchange(Outcome.FAILED, f"content-type {r.headers.get('content-type')!r}", status)
            events: list[str] = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if spec.disconnect == "mid" and len(events) >= spec.disconnect_after and events[-1] != "[DONE]":
                        return Exchange(Outcome.DISCONNECTED, None, "cut")  # leaving the block drops the connection
            include_usage = bool((spec.body.get("stream_options") or {}).get("include_usage"))
            return _judged(*validate_stream(spec, events, include_usage), status)
    except httpx.HTTPError as exc:
        return Exchange(Outcome.FAILED, f"transport error {exc!r}", "transport")


def _judged(problem: str | None, answer: Answer | None, status: int) -> Exchange:
    if problem:
        return Exchange(Outcome.FAILED, problem, status)
    return Exchange(Outcome.COMPLETED, None, status, answer)
