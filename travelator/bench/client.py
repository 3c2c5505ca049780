"""Online load generator: streaming OpenAI completions against a server URL.

Each request is sent at its arrival time (Poisson or gamma gaps), optionally under a
cap on requests in flight, as ``POST /v1/completions`` with ``stream: true``, the
prompt as token ids, ``max_tokens`` and ``ignore_eos`` (a vLLM extension travelator
also accepts) so that outputs have their forced lengths. From the client's side it
records the time of every streamed chunk (server-sent events, ``data:`` lines ending
with ``data: [DONE]``), the first of which is the time to first token.

Latencies are measured from the moment a request is sent (after it gets past the
concurrency cap, as vLLM's benchmark does).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from travelator.bench.metrics import RequestResult
from travelator.bench.runner import RunResult
from travelator.bench.workloads import Workload


@dataclass(slots=True)
class ServerTarget:
    """The server a benchmark sends its requests to."""

    base_url: str
    model: str | None = None  # the served model name; asked from /v1/models when None
    api_key: str | None = None
    timeout_s: float = 600.0  # per request


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model_name(client: httpx.AsyncClient, base_url: str) -> str | None:
    try:
        r = await client.get(f"{base_url}/v1/models")
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data:
                return data[0].get("id")
    except (httpx.HTTPError, ValueError):
        pass
    return None


async def _one_request(client: httpx.AsyncClient, url: str, payload: dict, res: RequestResult,
                       clock) -> None:
    res.arrival = clock()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                res.end = clock()
                return
            usage_tokens = None
            finish_reason = None
            events = 0
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = clock()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    res.error = f"bad SSE payload: {data[:200]}"
                    break
                if chunk.get("error"):
                    res.error = f"server error: {chunk['error']}"
                    break
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                choice = choices[0]
                text = choice.get("text") or ""
                fin = choice.get("finish_reason")
                if fin:
                    finish_reason = fin
                # A chunk that only carries the finish reason is not a token.
                if text or not fin:
                    res.token_times.append(now)
                    events += 1
            res.end = clock()
            if res.error:
                return
            res.output_len = usage_tokens if usage_tokens is not None else events
            res.success = res.output_len > 0 and finish_reason in ("length", "stop", None)
            if not res.success:
                res.error = f"finish_reason={finish_reason}, {res.output_len} tokens"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        res.end = clock()


async def run_serve_async(target: ServerTarget, workload: Workload, arrivals,
                          *, max_concurrency: int | None = None, progress: bool = True,
                          desc: str = "requests") -> RunResult:
    n = len(workload)
    arrivals = np.asarray(arrivals, dtype=float)
    limits = httpx.Limits(max_connections=max(n, 1), max_keepalive_connections=max(n, 1))
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    url = target.base_url.rstrip("/") + "/v1/completions"
    results = [RequestResult(r.prompt_len, r.output_len, float(a))
               for r, a in zip(workload.requests, arrivals)]
    async with httpx.AsyncClient(limits=limits, timeout=timeout,
                                 headers=_headers(target.api_key)) as client:
        model = target.model or await served_model_name(client, target.base_url.rstrip("/"))
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=n, desc=desc, unit="req", disable=not progress, leave=False)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        async def send(i: int) -> None:
            spec = workload.requests[i]
            delay = arrivals[i] - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = {
                "prompt": spec.prompt_token_ids, "max_tokens": spec.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }
            if model:
                payload["model"] = model
            if sem is None:
                await _one_request(client, url, payload, results[i], clock)
            else:
                async with sem:
                    await _one_request(client, url, payload, results[i], clock)
            bar.update(1)

        await asyncio.gather(*(send(i) for i in range(n)))
        duration = clock()
        bar.close()
    return RunResult(results, duration)


def run_serve(target: ServerTarget, workload: Workload, arrivals, **kw) -> RunResult:
    return asyncio.run(run_serve_async(target, workload, arrivals, **kw))

