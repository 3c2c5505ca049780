"""The soak run: start a server (or take a URL), calibrate the workload to it, send the load with
self-checks running alongside, then check the server at rest and stop it.

By default the server is started here on a free port of 127.0.0.1 (one torch thread, a KV pool
small enough to force preemption, a short waiting queue, the debug endpoint on). With a URL it
drives a running server instead (started with ``TRAVELATOR_DEBUG_ENDPOINTS=1`` for the full
checks; without it only /metrics is read).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import signal
import sys
import time

import httpx

from travelator.bench.soak.checks import VALID_FINISH, Outcome, at_rest_problems, chaos_problems
from travelator.bench.soak.config import SoakConfig, SoakResult
from travelator.bench.soak.greedy import compare_alone
from travelator.bench.soak.send import send
from travelator.bench.soak.workload import (CHAT_MESSAGES, LONG_PROMPTS, SHARED_PREFIX_PROMPTS, SHORT_PROMPTS,
                                            Workload)
from travelator.default_model import default_model
from travelator.server.process import ServerProcess, free_port, serve_command


def own_server(cfg: SoakConfig) -> ServerProcess:
    """``travelator serve`` as the soak wants it: small, under pressure, with the debug endpoint."""
    args = ["--dtype", "float32", "--num-kv-blocks", str(cfg.num_kv_blocks),
            "--block-size", str(cfg.block_size), "--max-model-len", str(cfg.max_model_len),
            "--max-num-seqs", str(cfg.max_num_seqs), "--max-waiting", str(cfg.max_waiting),
            "--shutdown-grace", "2"]
    if cfg.model:
        args += ["--model", cfg.model]
    if cfg.api_key:
        args += ["--api-key", cfg.api_key]
    if cfg.disaggregate:
        args += ["--disaggregate", cfg.disaggregate, "--worker-threads", str(cfg.server_threads)]
    if cfg.everything:
        args += ["--batch-invariant", "--scheduling-policy", "priority"]
    if cfg.speculative_method:
        # fixed: drafts in every decode step, the most verification under load (adaptive may
        # decide that a loaded batch of 8 is better off without them).
        args += ["--speculative-method", cfg.speculative_method, "--speculative-policy", "fixed"]
        if cfg.speculative_method == "draft":
            args += ["--draft-model", cfg.model or default_model()]
    threads = str(cfg.server_threads)
    env = {"TRAVELATOR_DEBUG_ENDPOINTS": "1", "OMP_NUM_THREADS": threads,
           "MKL_NUM_THREADS": threads, "TRAVELATOR_STEP_TIMEOUT_S": "60"}
    port = free_port()
    return ServerProcess(serve_command(args, port), port, env=env, log_path=cfg.server_log)


def phases(cfg: SoakConfig) -> tuple[list[str | None], list[str]]:
    """The speculative method of each server in turn, and the features left out.

    ``--everything`` on a server started here runs two servers one after the other, half the
    requests each: n-gram speculation, then a draft model (the model itself), so every run
    covers both methods (a server takes one). Disaggregated serving refuses structured outputs
    and draft models: one n-gram phase without them. A server given by URL is taken as it is.
    """
    if not cfg.everything or cfg.url:
        return [cfg.speculative_method], []
    if cfg.disaggregate:
        return ["ngram"], ["structured_outputs", "draft_model"]
    return ["ngram", "draft"], []


def run_soak(cfg: SoakConfig) -> SoakResult:
    """Run the soak; never raises for a failed check (see ``SoakResult.failures``)."""
    result = SoakResult()
    if cfg.everything and importlib.util.find_spec("jsonschema") is None:
        result.failures.append("--everything checks JSON answers with jsonschema, which is not installed "
                               "(the test extra brings it)")
        return result
    methods, result.skipped = phases(cfg)
    limit = cfg.time_limit_s
    if limit is None:
        limit = (cfg.duration_s if cfg.duration_s is not None else max(60.0, cfg.requests * 0.5)) + 180.0
    start = 0
    for k, method in enumerate(methods):
        stop = cfg.requests * (k + 1) // len(methods)
        if cfg.everything:
            result.phases.append(method or "as served")
        if not _run_phase(dataclasses.replace(cfg, speculative_method=method), result, start, stop,
                          limit / len(methods)):
            break
        start = stop
    result.failures += chaos_problems(cfg, result, own_server=cfg.url is None)
    return result


def _run_phase(cfg: SoakConfig, result: SoakResult, start: int, stop: int, limit: float) -> bool:
    """Requests ``start``..``stop`` on one server (started here unless ``cfg.url``); False if
    the server did not start."""
    server = None if cfg.url else own_server(cfg)
    failures_before = len(result.failures)
    try:
        if server is not None:
            server.start()
        url = cfg.url or server.base_url
        try:
            asyncio.run(asyncio.wait_for(_drive(cfg, url, result, start, stop), limit))
        except asyncio.TimeoutError:
            result.failures.append(f"the run did not finish within its time limit of {limit:.0f} s")
        except (httpx.HTTPError, OSError, RuntimeError, KeyError, ValueError) as exc:
            result.failures.append(f"the run broke off: {exc!r}")
        if server is not None:
            code = server.stop()
            if code != 0:
                result.failures.append(f"the server exited with {code} on SIGTERM (expected 0)")
    except RuntimeError as exc:  # the server did not start
        result.failures.append(str(exc))
        return False
    finally:
        if server is not None:
            server.kill()
            if len(result.failures) > failures_before:
                print(f"soak: server log ({server.log_path}), last lines:\n{server.log_tail()}",
                      file=sys.stderr)
            server.close()
    return True


# ---------------------------------------------------------------------------- the phases


async def _drive(cfg: SoakConfig, url: str, result: SoakResult, start: int, stop: int) -> None:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    burst = cfg.effective_burst_size if cfg.burst_every else 0
    limits = httpx.Limits(max_connections=cfg.concurrency + burst + 8,
                          max_keepalive_connections=cfg.concurrency + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:
        r = await client.get("/health")
        if r.status_code != 200:
            result.failures.append(f"/health is {r.status_code} before the run: {r.text[:200]}")
            return
        debug = (await client.get("/debug/engine")).status_code == 200
        if not debug:
            print("soak: /debug/engine is off on this server; checking through /metrics only",
                  file=sys.stderr)
        workload = Workload(cfg, *await _calibrate(client))
        before = (await client.get("/metrics")).text
        watcher = asyncio.ensure_future(_monitor(client, result)) if debug else None
        t0 = time.monotonic()
        await _send_load(client, cfg, workload, burst, result, start, stop)
        result.duration_s += time.monotonic() - t0
        if watcher is not None:
            watcher.cancel()
        if result.greedy_pending:
            try:
                await _wait_idle(client, cfg.quiesce_timeout_s, debug)  # alone means alone
            except TimeoutError as exc:
                result.failures.append(str(exc))
            await compare_alone(client, cfg, result)
        await _check_at_rest(client, cfg, result, before, debug)


async def _calibrate(client: httpx.AsyncClient) -> tuple[dict[str, int], list[int | None], int]:
    """Token counts of the fixed prompts (from usage) and the served context length."""
    models = (await client.get("/v1/models")).json()["data"]
    max_model_len = int(models[0].get("max_model_len") or 2048)
    counts: dict[str, int] = {}
    for text in SHORT_PROMPTS + LONG_PROMPTS + SHARED_PREFIX_PROMPTS:
        r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0})
        if r.status_code == 400:  # longer than this server's context: not used
            continue
        r.raise_for_status()
        counts[text] = r.json()["usage"]["prompt_tokens"]
    chat: list[int | None] = []
    for messages in CHAT_MESSAGES:
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        if r.status_code == 400:
            chat.append(None)
            continue
        r.raise_for_status()
        chat.append(r.json()["usage"]["prompt_tokens"])
    if not any(t in counts for t in SHORT_PROMPTS) or chat[0] is None:
        raise RuntimeError(f"the server's context ({max_model_len} tokens) is too short for the workload")
    return counts, chat, max_model_len


async def _monitor(client: httpx.AsyncClient, result: SoakResult) -> None:
    """Self-checks while the load runs: the accounting must hold between any two steps."""
    while True:
        await asyncio.sleep(1.0)
        try:
            report = (await client.get("/debug/engine")).json()
        except (httpx.HTTPError, ValueError) as exc:
            result.failures.append(f"a self-check during the run failed: {exc!r}")
            return
        result.self_checks += 1
        if not report.get("ok", True):
            result.failures.append(f"self-check during the run: {report['problems']}")
            return


async def _kill_a_decode_worker(client: httpx.AsyncClient, result: SoakResult) -> None:
    """SIGKILL the last decode worker of the disaggregated server this soak started (its pid
    from /debug/engine): the requests it held must fail with a clear error, the rest go on."""
    workers = (await client.get("/debug/engine")).json().get("workers") or {}
    decode = sorted(name for name, w in workers.items() if name.startswith("decode") and w["alive"])
    if len(decode) < 2:
        result.failures.append(f"killing a decode worker needs two alive; the server has {decode}")
        return
    name = decode[-1]
    result.killed_worker = name
    os.kill(workers[name]["pid"], signal.SIGKILL)
    print(f"soak: killed {name} (pid {workers[name]['pid']})", file=sys.stderr)


async def _send_load(client: httpx.AsyncClient, cfg: SoakConfig, workload: Workload, burst: int,
                     result: SoakResult, start: int, stop: int) -> None:
    """Regular clients, ``cfg.concurrency`` at a time, and every ``cfg.burst_every`` of them a
    burst of ``burst`` requests at once; requests ``start``..``stop``, or until ``cfg.duration_s``."""
    t0 = time.monotonic()
    sem = asyncio.Semaphore(cfg.concurrency)
    tasks: set[asyncio.Task] = set()

    async def regular(index: int) -> None:
        try:
            if await send(client, workload.make(index), cfg, result) == Outcome.REJECTED:
                await asyncio.sleep(0.25)  # a polite client backs off (the 503 says Retry-After)
        finally:
            sem.release()

    index, since_burst = start, 0
    while index < stop:
        if cfg.duration_s is not None and time.monotonic() - t0 > cfg.duration_s:
            break
        if (cfg.kill_decode_worker_after is not None and index >= cfg.kill_decode_worker_after
                and result.killed_worker is None):
            await _kill_a_decode_worker(client, result)
        if burst and since_burst >= cfg.burst_every:
            since_burst = 0
            for _ in range(min(burst, stop - index)):
                tasks.add(asyncio.ensure_future(send(client, workload.make(index, burst=True), cfg, result)))
                index += 1
            result.sent = index
            continue
        await sem.acquire()
        tasks.add(asyncio.ensure_future(regular(index)))
        tasks = {t for t in tasks if not t.done()}
        index += 1
        since_burst += 1
        result.sent = index
        if cfg.verbose and index % 100 == 0:
            print(f"soak: {index} sent, {result.completed} completed, {len(result.failures)} failures "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    if tasks:
        await asyncio.gather(*tasks)


def _metric(text: str, name: str, label: str | None = None) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            if label is not None and label not in line:
                continue
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def _grew(before: str, after: str, name: str) -> int:
    return int((_metric(after, name) or 0) - (_metric(before, name) or 0))


async def _wait_idle(client: httpx.AsyncClient, timeout: float, debug: bool) -> dict | None:
    """The last self-check (or None without the debug endpoint) once the server is idle."""
    deadline = time.monotonic() + timeout
    while True:
        if debug:
            report = (await client.get("/debug/engine")).json()
            if report.get("idle"):
                return report
        else:
            text = (await client.get("/metrics")).text
            busy = sum(_metric(text, n) or 0 for n in ("travelator_num_requests_in_flight",
                                                        "travelator_num_requests_running",
                                                        "travelator_num_requests_waiting"))
            if busy == 0:
                return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is not idle {timeout} s after the last request"
                               + (f": {json.dumps(report)[:1500]}" if debug else ""))
        await asyncio.sleep(0.2)


async def _check_at_rest(client: httpx.AsyncClient, cfg: SoakConfig, result: SoakResult,
                         metrics_before: str, debug: bool) -> None:
    """Once idle: the engine's own accounting, the metrics, /health, and one more request."""
    try:
        report = await _wait_idle(client, cfg.quiesce_timeout_s, debug)
    except TimeoutError as exc:
        result.failures.append(str(exc))
        report = None
    after = (await client.get("/metrics")).text
    if report is not None:
        result.leaked_blocks = (result.leaked_blocks or 0) + report["kv"]["used_blocks"]
        result.failures += at_rest_problems(report)
    elif not debug:
        used = _metric(after, "travelator_kv_cache_used_blocks")
        result.leaked_blocks = None if used is None else (result.leaked_blocks or 0) + int(used)
        if used:
            result.failures.append(f"{used:.0f} KV blocks still in use at rest")
    result.preemptions = (result.preemptions or 0) + _grew(metrics_before, after, "travelator_num_preemptions_total")
    if cfg.everything:
        for field, name in (("prefix_hit_tokens", "travelator_prefix_cache_hit_tokens_total"),
                            ("draft_tokens", "travelator_spec_draft_tokens_total"),
                            ("accepted_draft_tokens", "travelator_spec_accepted_tokens_total")):
            setattr(result, field, (getattr(result, field) or 0) + _grew(metrics_before, after, name))
    error = 'finished_reason="error"'
    errors = ((_metric(after, "travelator_request_success_total", error) or 0)
              - (_metric(metrics_before, "travelator_request_success_total", error) or 0))
    # The only errors allowed: the killed worker's (an HTTP request's choices are engine requests).
    if errors > result.killed_choices:
        result.failures.append(f"{errors:.0f} engine requests finished with an error, more than the "
                               f"{result.killed_choices} of the HTTP requests that failed with the killed worker")
    r = await client.get("/health")
    if r.status_code != 200:
        result.failures.append(f"/health is {r.status_code} after the run: {r.text[:200]}")
    r = await client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                   "temperature": 0})
    if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in VALID_FINISH:
        result.failures.append(f"a last request after the run got {r.status_code}: {r.text[:200]}")
    if report is not None and debug:
        final = (await client.get("/debug/engine")).json()
        if not final["ok"] or final["kv"]["used_blocks"]:
            result.failures.append(f"after the last request: {final['problems']}, "
                                   f"{final['kv']['used_blocks']} blocks used")
