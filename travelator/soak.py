"""Soak and chaos test of a live server: a mixed workload, then the engine's own accounting.

    python -m travelator.soak --requests 2000          # starts `travelator serve` itself
    python -m travelator.soak --duration 600 --requests 100000
    python -m travelator.soak --url http://127.0.0.1:8000 --requests 500

By default it starts a server on a free port of 127.0.0.1 (stories260K, one torch thread, a KV
pool small enough to force preemption, a short waiting queue, the debug endpoint on). With
``--url`` it drives a running server instead (started with ``TRAVELATOR_DEBUG_ENDPOINTS=1`` for
the full checks; without it only /metrics is read).

The workload mixes completions and chat, streaming and not, n > 1 and prompt batches, stop
strings, logprobs, greedy and seeded sampling, very short and very long requests; about
``--disconnect-rate`` of the clients go away at a random moment (before the first token, mid
stream, or while a non-streaming request waits); every ``--burst-every`` requests a burst of
requests above the waiting-queue bound is fired at once (503 expected for some); a few requests
are deliberately invalid (4xx expected).

Every answer is checked (a valid completion with a finish reason for each choice, the stop
strings honoured, usage that adds up, a stream that ends in ``[DONE]`` with no error event).
Then it waits for the server to be idle and checks through ``/debug/engine``: every KV block back
in the pool, free + used = total, the pool's consistency check, no running or waiting request,
no per-request state left behind; through /metrics: no request finished with an engine error;
and that /health is 200 and a last request still succeeds. A server it started must also stop
cleanly on SIGTERM (exit code 0).

Prints ONE line on stdout with the figures; failed checks are listed on stderr, and the exit
code is 1 if any check failed. Bounded by ``--requests`` and ``--duration`` and by a hard
``--time-limit``: it always stops by itself. Only 127.0.0.1 is ever contacted when it starts
the server itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["SoakConfig", "SoakResult", "run_soak", "main"]

VALID_FINISH = {"stop", "length"}

# Prompts: short ones, and long ones (a few hundred characters) to fill KV blocks fast.
SHORT_PROMPTS = ["Once upon a time", "Lily and Ben", "The dog", "One day, a little girl", "Tom had a big",
                 "Sue was sad because", "The sun", "A bird"]
_STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, she saw a big, red ball. She wanted to play with it, but it was too high. ")
LONG_PROMPTS = [_STORY * 2, "Tom and Sue went to the park. " * 8, _STORY + "Then Ben came and said"]
CHAT_MESSAGES = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A dog and a ball."}],
    [{"role": "user", "content": _STORY}],
]
STOP_CHOICES = ["Lily", ".", "\n", " the", "!", ",", "zzz-never"]


# ---------------------------------------------------------------------------- configuration


@dataclass
class SoakConfig:
    url: str | None = None  # None: start a server here
    model: str | None = None  # for the server started here (default: travelator's built-in)
    requests: int = 300  # most requests sent (bursts and invalid ones included)
    duration_s: float | None = None  # stop sending after this long
    time_limit_s: float | None = None  # hard limit of the whole run (default from the above)
    concurrency: int = 8  # regular clients at once (bursts come on top)
    seed: int = 0
    disconnect_rate: float = 0.3  # share of clients that try to leave (some finish first)
    burst_every: int = 100  # regular requests between two bursts (0: no bursts)
    burst_size: int | None = None  # default: max_waiting + max_num_seqs + 8 (more than fit)
    invalid_rate: float = 0.03
    long_rate: float = 0.2
    request_timeout_s: float = 120.0  # a request not answered in this long counts as hung
    quiesce_timeout_s: float = 30.0
    api_key: str | None = None
    require_chaos: bool | None = None  # demand preemptions, 503s and disconnects (default: own server)
    # The server started here.
    num_kv_blocks: int = 24
    block_size: int = 16
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_waiting: int = 32
    server_threads: int = 1
    server_log: str | None = None  # where its log goes (default: a temporary file)
    verbose: bool = False

    @property
    def effective_burst_size(self) -> int:
        return self.burst_size if self.burst_size is not None else self.max_waiting + self.max_num_seqs + 8


@dataclass
class SoakResult:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    rejected_503: int = 0
    invalid_4xx: int = 0
    server_errors_5xx: int = 0
    preemptions: int | None = None
    leaked_blocks: int | None = None
    latencies: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    self_checks: int = 0  # self-checks passed while the load ran
    failures: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.failures

    def p(self, q: float) -> float | None:
        if not self.latencies:
            return None
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    def line(self) -> str:
        def fmt(x, digits=3):
            return "n/a" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))
        return (f"soak: sent={self.sent} completed={self.completed} disconnected={self.disconnected} "
                f"rejected_503={self.rejected_503} invalid_4xx={self.invalid_4xx} "
                f"preemptions={fmt(self.preemptions)} leaked_blocks={fmt(self.leaked_blocks)} "
                f"5xx={self.server_errors_5xx} p50_latency_s={fmt(self.p(0.5))} "
                f"p99_latency_s={fmt(self.p(0.99))} self_checks={self.self_checks} duration_s={self.duration_s:.1f} "
                f"result={'PASS' if self.ok else f'FAIL({len(self.failures)})'}")


# ---------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _OwnServer:
    """`travelator serve` in a child process, on 127.0.0.1, with the debug endpoint on."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if cfg.server_log:
            self.log_path = Path(cfg.server_log)
            self._tmp = None
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="travelator-soak-")
            self.log_path = Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> None:
        cfg = self.cfg
        cmd = [sys.executable, "-m", "travelator.cli", "serve", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--num-kv-blocks", str(cfg.num_kv_blocks), "--block-size", str(cfg.block_size),
               "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
               "--max-waiting", str(cfg.max_waiting), "--shutdown-grace", "2"]
        if cfg.model:
            cmd += ["--model", cfg.model]
        if cfg.api_key:
            cmd += ["--api-key", cfg.api_key]
        threads = str(cfg.server_threads)
        env = {**os.environ, "TRAVELATOR_DEBUG_ENDPOINTS": "1", "OMP_NUM_THREADS": threads,
               "MKL_NUM_THREADS": threads, "TRAVELATOR_STEP_TIMEOUT_S": "60"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM; the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


# ---------------------------------------------------------------------------- the workload


@dataclass
class _Spec:
    index: int
    path: str
    body: dict
    stream: bool
    choices: int  # prompts x n
    max_tokens: int
    stops: list[str]
    include_stop: bool
    invalid: bool = False
    burst: bool = False
    disconnect: str | None = None  # None, "early", "mid", "wait"
    disconnect_after: float = 0.0  # seconds ("early", "wait") or chunks ("mid")


class _Workload:
    def __init__(self, cfg: SoakConfig, prompt_tokens: dict[str, int], chat_tokens: list[int | None],
                 max_model_len: int) -> None:
        self.cfg = cfg
        self.prompt_tokens = prompt_tokens
        self.chat_tokens = chat_tokens
        self.max_model_len = max_model_len
        # Only the prompts that fit the server's context.
        self.short = [t for t in SHORT_PROMPTS if t in prompt_tokens]
        self.long = [t for t in LONG_PROMPTS if t in prompt_tokens] or self.short
        self.chats = [i for i, n in enumerate(chat_tokens) if n is not None]

    def _room(self, n_prompt: int) -> int:
        return max(1, self.max_model_len - n_prompt - 1)

    def _max_tokens(self, rng: random.Random, n_prompt: int, long: bool) -> tuple[int, bool]:
        room = self._room(n_prompt)
        if long:
            return max(1, min(room, rng.randint(room // 2, room))), True
        if rng.random() < 0.3:
            return min(room, rng.randint(1, 3)), False
        return min(room, rng.randint(6, 40)), rng.random() < 0.3

    def make(self, index: int, burst: bool = False) -> _Spec:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1_000_003 + index)
        if not burst and rng.random() < cfg.invalid_rate:
            return self._invalid(index, rng)
        long = not burst and rng.random() < cfg.long_rate
        chat = not burst and rng.random() < 0.3
        stream = not burst and rng.random() < 0.5
        n = 1 if burst or rng.random() < 0.75 else rng.randint(2, 3)
        body: dict = {}  # no "model": the server's default
        if chat:
            which = 2 if long and 2 in self.chats else rng.choice([i for i in self.chats if i < 2] or self.chats)
            body["messages"] = CHAT_MESSAGES[which]
            n_prompt = self.chat_tokens[which]
            prompts = 1
            path = "/v1/chat/completions"
        else:
            path = "/v1/completions"
            r = rng.random()
            if long:  # a long prompt, or a short one with a long output
                text = rng.choice(self.long if rng.random() < 0.5 else self.short)
                body["prompt"] = text
                n_prompt, prompts = self.prompt_tokens[text], 1
            elif r < 0.12 and not burst:
                texts = rng.sample(self.short, 2)
                body["prompt"] = texts
                n_prompt, prompts = max(self.prompt_tokens[t] for t in texts), 2
            elif r < 0.22 and not burst:
                ids = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
                body["prompt"] = ids
                n_prompt, prompts = len(ids), 1
            else:
                text = rng.choice(self.short)
                body["prompt"] = text
                n_prompt, prompts = self.prompt_tokens[text], 1
        max_tokens, ignore_eos = (rng.randint(1, 8), False) if burst else self._max_tokens(rng, n_prompt, long)
        body["max_tokens"] = max_tokens
        if ignore_eos:
            body["ignore_eos"] = True
        if n > 1:
            body["n"] = n
        if rng.random() < 0.4:
            body["temperature"] = 0
        else:
            body["temperature"] = round(rng.uniform(0.5, 1.0), 2)
            body["seed"] = rng.randrange(1 << 30)
        stops, include = [], False
        if not burst and rng.random() < 0.3:
            stops = rng.sample(STOP_CHOICES, rng.randint(1, 2))
            body["stop"] = stops if len(stops) > 1 or rng.random() < 0.5 else stops[0]
            include = rng.random() < 0.3
            if include:
                body["include_stop_str_in_output"] = True
        if not burst and rng.random() < 0.1:
            if chat:
                body.update(logprobs=True, top_logprobs=2)
            else:
                body["logprobs"] = 2
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        spec = _Spec(index, path, body, stream, prompts * n, max_tokens, stops, include, burst=burst)
        if not burst and rng.random() < cfg.disconnect_rate:
            mode = rng.choice(["early", "mid", "wait"] if stream else ["early", "wait"])
            spec.disconnect = mode
            if mode == "early":
                spec.disconnect_after = rng.uniform(0.0, 0.05)
            elif mode == "mid":
                spec.disconnect_after = rng.randint(1, 4)
            else:
                spec.disconnect_after = rng.uniform(0.02, 0.5)
        return spec

    def _invalid(self, index: int, rng: random.Random) -> _Spec:
        bodies = [
            ("/v1/completions", {"prompt": ""}),
            ("/v1/completions", {"prompt": "Once", "max_tokens": -1}),
            ("/v1/completions", {"prompt": "Once", "temperature": -1}),
            ("/v1/completions", {"prompt": "Once", "n": 10_000}),
            ("/v1/completions", {"prompt": "Once", "max_tokens": 10 * self.max_model_len}),
            ("/v1/completions", {"prompt": "Once", "model": "no-such-model"}),
            ("/v1/completions", {"prompt": [1, 10**9]}),
            ("/v1/chat/completions", {"messages": []}),
            ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ]
        path, body = rng.choice(bodies)
        return _Spec(index, path, body, False, 1, 0, [], False, invalid=True)


# ---------------------------------------------------------------------------- one request


class _Outcome:
    COMPLETED, DISCONNECTED, REJECTED, INVALID, FAILED = "completed", "disconnected", "rejected", "invalid", "failed"


def _check_text(spec: _Spec, text: str, finish: str, stop_reason) -> str | None:
    if finish not in VALID_FINISH:
        return f"finish_reason {finish!r}"
    if not isinstance(text, str):
        return f"text is {type(text).__name__}"
    if spec.stops and not spec.include_stop:
        bad = [s for s in spec.stops if s in text]
        if bad:
            return f"stop string {bad[0]!r} in the text {text!r}"
    if finish == "stop" and isinstance(stop_reason, str):
        if stop_reason not in spec.stops:
            return f"stop_reason {stop_reason!r} is none of {spec.stops}"
        if spec.include_stop and not text.endswith(stop_reason):
            return f"text {text!r} does not end with the included stop string {stop_reason!r}"
    return None


def _check_usage(spec: _Spec, usage: dict | None, finishes: list[str]) -> str | None:
    if not isinstance(usage, dict):
        return "no usage"
    pt, ct, tt = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if not all(isinstance(x, int) and x >= 0 for x in (pt, ct, tt)) or pt + ct != tt or pt < 1:
        return f"usage does not add up: {usage}"
    if ct > spec.choices * spec.max_tokens:
        return f"{ct} completion tokens for {spec.choices} choices of at most {spec.max_tokens}"
    if finishes and all(f == "length" for f in finishes) and ct != spec.choices * spec.max_tokens:
        return f"every choice ended by length but usage says {ct} tokens, not {spec.choices}x{spec.max_tokens}"
    return None


def _validate_json(spec: _Spec, data: dict) -> str | None:
    chat = spec.path.endswith("chat/completions")
    want = "chat.completion" if chat else "text_completion"
    if data.get("object") != want:
        return f"object {data.get('object')!r}, expected {want}"
    choices = data.get("choices")
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(spec.choices)):
        return f"choices {choices!r:.200} are not indices 0..{spec.choices - 1}"
    finishes = []
    for c in choices:
        text = c["message"]["content"] if chat else c.get("text")
        problem = _check_text(spec, text, c.get("finish_reason"), c.get("stop_reason"))
        if problem:
            return f"choice {c.get('index')}: {problem}"
        finishes.append(c["finish_reason"])
    return _check_usage(spec, data.get("usage"), finishes)


def _validate_stream(spec: _Spec, events: list[str], include_usage: bool) -> str | None:
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE]: {events[-2:]!r}"
    chat = spec.path.endswith("chat/completions")
    texts: dict[int, str] = {}
    finished: dict[int, tuple[str, object]] = {}
    usage = None
    for raw in events[:-1]:
        try:
            chunk = json.loads(raw)
        except json.JSONDecodeError:
            return f"an event is not JSON: {raw[:200]!r}"
        if "error" in chunk:
            return f"error event: {chunk['error']}"
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            i = c.get("index")
            if i in finished:
                return f"choice {i} got a chunk after its finish_reason"
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            texts[i] = texts.get(i, "") + (piece or "")
            if c.get("finish_reason") is not None:
                finished[i] = (c["finish_reason"], c.get("stop_reason"))
    if sorted(finished) != list(range(spec.choices)):
        return f"finish reasons for choices {sorted(finished)}, expected 0..{spec.choices - 1}"
    for i, (finish, stop_reason) in finished.items():
        problem = _check_text(spec, texts.get(i, ""), finish, stop_reason)
        if problem:
            return f"choice {i}: {problem}"
    if include_usage:
        return _check_usage(spec, usage, [f for f, _ in finished.values()])
    return None


async def _send(client: httpx.AsyncClient, spec: _Spec, cfg: SoakConfig, result: SoakResult) -> str:
    t0 = time.monotonic()
    outcome, problem, status = await _send_inner(client, spec, cfg)
    elapsed = time.monotonic() - t0
    result.statuses[status] += 1
    if isinstance(status, int) and status >= 500 and status != 503:
        result.server_errors_5xx += 1
    if outcome == _Outcome.COMPLETED:
        result.completed += 1
        result.latencies.append(elapsed)
    elif outcome == _Outcome.DISCONNECTED:
        result.disconnected += 1
    elif outcome == _Outcome.REJECTED:
        result.rejected_503 += 1
    elif outcome == _Outcome.INVALID:
        result.invalid_4xx += 1
    else:
        body = json.dumps(spec.body)[:300]
        result.failures.append(f"request {spec.index} {spec.path} {body}: status {status}: {problem}")
    return outcome


async def _send_inner(client: httpx.AsyncClient, spec: _Spec, cfg: SoakConfig):
    """(outcome, problem, status) for one request, cutting it short as the spec says."""
    if spec.disconnect in ("early", "wait"):
        task = asyncio.ensure_future(_exchange(client, spec))
        done, _ = await asyncio.wait({task}, timeout=spec.disconnect_after)
        if not done:
            task.cancel()  # the connection is dropped: the server sees the client go
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            return _Outcome.DISCONNECTED, None, "cut"
        return task.result()
    try:
        return await asyncio.wait_for(_exchange(client, spec), cfg.request_timeout_s)
    except asyncio.TimeoutError:
        return _Outcome.FAILED, f"no answer in {cfg.request_timeout_s} s (a hang)", "timeout"


async def _exchange(client: httpx.AsyncClient, spec: _Spec):
    try:
        async with client.stream("POST", spec.path, json=spec.body) as r:
            status = r.status_code
            if status != 200:
                raw = await r.aread()
                return _judge_error(spec, status, raw)
            if not spec.stream:
                raw = await r.aread()
                try:
                    data = json.loads(raw)
                except json.JSONDecodeError:
                    return _Outcome.FAILED, f"not JSON: {raw[:200]!r}", status
                if spec.invalid:
                    return _Outcome.FAILED, "an invalid request was answered 200", status
                problem = _validate_json(spec, data)
                return (_Outcome.FAILED, problem, status) if problem else (_Outcome.COMPLETED, None, status)
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                return _Outcome.FAILED, f"content-type {r.headers.get('content-type')!r}", status
            events: list[str] = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if spec.disconnect == "mid" and len(events) >= spec.disconnect_after and events[-1] != "[DONE]":
                        return _Outcome.DISCONNECTED, None, "cut"  # leaving the block drops the connection
            include_usage = bool((spec.body.get("stream_options") or {}).get("include_usage"))
            problem = _validate_stream(spec, events, include_usage)
            return (_Outcome.FAILED, problem, status) if problem else (_Outcome.COMPLETED, None, status)
    except httpx.HTTPError as exc:
        return _Outcome.FAILED, f"transport error {exc!r}", "transport"


def _judge_error(spec: _Spec, status: int, raw: bytes):
    try:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"]
    except Exception:  # noqa: BLE001
        return _Outcome.FAILED, f"error without an OpenAI error body: {raw[:200]!r}", status
    if status == 503 and err.get("code") == "queue_full":
        return _Outcome.REJECTED, None, status
    if spec.invalid and 400 <= status < 500:
        return _Outcome.INVALID, None, status
    return _Outcome.FAILED, f"{err.get('code')}: {err['message'][:200]}", status


# ---------------------------------------------------------------------------- the run


def _metric(text: str, name: str, label: str | None = None) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if label is not None and label not in line:
                continue
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


async def _calibrate(client: httpx.AsyncClient) -> tuple[dict[str, int], list[int], int]:
    """Token counts of the fixed prompts (from usage) and the served context length."""
    models = (await client.get("/v1/models")).json()["data"]
    max_model_len = int(models[0].get("max_model_len") or 2048)
    counts: dict[str, int] = {}
    for text in SHORT_PROMPTS + LONG_PROMPTS:
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


async def _drive(cfg: SoakConfig, url: str, result: SoakResult, own: bool) -> None:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    burst = cfg.effective_burst_size if cfg.burst_every else 0
    limits = httpx.Limits(max_connections=cfg.concurrency + burst + 8, max_keepalive_connections=cfg.concurrency + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:
        r = await client.get("/health")
        if r.status_code != 200:
            result.failures.append(f"/health is {r.status_code} before the run: {r.text[:200]}")
            return
        debug = (await client.get("/debug/engine")).status_code == 200
        if not debug:
            print("soak: /debug/engine is off on this server; checking through /metrics only", file=sys.stderr)
        prompt_tokens, chat_tokens, max_model_len = await _calibrate(client)
        workload = _Workload(cfg, prompt_tokens, chat_tokens, max_model_len)
        before = (await client.get("/metrics")).text

        t0 = time.monotonic()
        sem = asyncio.Semaphore(cfg.concurrency)
        tasks: set[asyncio.Task] = set()

        async def regular(spec: _Spec) -> None:
            try:
                if await _send(client, spec, cfg, result) == _Outcome.REJECTED:
                    await asyncio.sleep(0.25)  # a polite client backs off (the 503 says Retry-After)
            finally:
                sem.release()

        async def monitor() -> None:
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

        watcher = asyncio.ensure_future(monitor()) if debug else None
        index = 0
        since_burst = 0
        while index < cfg.requests:
            if cfg.duration_s is not None and time.monotonic() - t0 > cfg.duration_s:
                break
            if burst and since_burst >= cfg.burst_every:
                since_burst = 0
                n = min(burst, cfg.requests - index)
                for _ in range(n):
                    tasks.add(asyncio.ensure_future(_send(client, workload.make(index, burst=True), cfg, result)))
                    index += 1
                result.sent = index
                continue
            await sem.acquire()
            tasks.add(asyncio.ensure_future(regular(workload.make(index))))
            tasks = {t for t in tasks if not t.done()}
            index += 1
            since_burst += 1
            result.sent = index
            if cfg.verbose and index % 100 == 0:
                print(f"soak: {index} sent, {result.completed} completed, {len(result.failures)} failures "
                      f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        if tasks:
            await asyncio.gather(*tasks)
        result.duration_s = time.monotonic() - t0
        if watcher is not None:
            watcher.cancel()

        # At rest: the engine's own accounting.
        try:
            report = await _wait_idle(client, cfg.quiesce_timeout_s, debug)
        except TimeoutError as exc:
            result.failures.append(str(exc))
            report = None
        after = (await client.get("/metrics")).text
        if report is not None:
            kv, reqs = report["kv"], report["requests"]
            result.leaked_blocks = kv["used_blocks"]
            checks = [
                (report["ok"], f"self-check problems: {report['problems']}"),
                (kv["used_blocks"] == 0 and kv["free_blocks"] == kv["total_blocks"],
                 f"{kv['used_blocks']} KV blocks still in use at rest (owners {kv['owners']})"),
                (kv["free_plus_used_equals_total"], f"free + used != total: {kv}"),
                (kv["consistency"] == "ok", f"KV consistency: {kv['consistency']}"),
                (reqs["running"] == 0 and reqs["waiting"] == 0,
                 f"requests left: running {reqs['running_ids']}, waiting {reqs['waiting_ids']}"),
                (report["detokenizers"] == 0, f"{report['detokenizers']} detokenizers left"),
                (report["streams"] == 0, f"{report['streams']} server streams left"),
                (report["healthy"], f"engine unhealthy: {report['error']}"),
            ]
            result.failures += [msg for ok, msg in checks if not ok]
        elif not debug:
            used = _metric(after, "travelator_kv_cache_used_blocks")
            result.leaked_blocks = None if used is None else int(used)
            if used:
                result.failures.append(f"{used:.0f} KV blocks still in use at rest")
        p0 = _metric(before, "travelator_num_preemptions_total") or 0
        p1 = _metric(after, "travelator_num_preemptions_total") or 0
        result.preemptions = int(p1 - p0)
        errors = (_metric(after, "travelator_request_success_total", 'finished_reason="error"') or 0) - (
            _metric(before, "travelator_request_success_total", 'finished_reason="error"') or 0)
        if errors:
            result.failures.append(f"{errors:.0f} requests finished with an engine error")
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

    require = cfg.require_chaos if cfg.require_chaos is not None else own
    if require and result.sent >= 100:
        if not result.preemptions:
            result.failures.append("no preemption happened: the KV pool was not under pressure")
        if burst and not result.rejected_503:
            result.failures.append("no burst was rejected with 503: the waiting-queue bound was never reached")
        if cfg.disconnect_rate > 0 and not result.disconnected:
            result.failures.append("no client disconnected")
    if result.server_errors_5xx:
        result.failures.append(f"{result.server_errors_5xx} answers were 5xx other than 503 "
                               f"(statuses: {dict(result.statuses)})")


def run_soak(cfg: SoakConfig) -> SoakResult:
    """Run the soak; never raises for a failed check (see ``SoakResult.failures``)."""
    result = SoakResult()
    server = None if cfg.url else _OwnServer(cfg)
    limit = cfg.time_limit_s
    if limit is None:
        limit = (cfg.duration_s if cfg.duration_s is not None else max(60.0, cfg.requests * 0.5)) + 180.0
    try:
        if server is not None:
            server.start()
        url = cfg.url or server.url
        try:
            asyncio.run(asyncio.wait_for(_drive(cfg, url, result, own=server is not None), limit))
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
    finally:
        if server is not None:
            server.kill()
            if result.failures:
                print(f"soak: server log ({server.log_path}), last lines:\n{server.log_tail()}", file=sys.stderr)
            server.cleanup()
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m travelator.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--url", help="drive this server instead of starting one (e.g. http://127.0.0.1:8000)")
    p.add_argument("--model", help="model of the server started here (default: travelator's built-in)")
    p.add_argument("--requests", type=int, default=d.requests, help=f"most requests to send (default {d.requests})")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--time-limit", type=float, default=None, help="hard limit of the whole run in seconds")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate)
    p.add_argument("--burst-every", type=int, default=d.burst_every, help="0: no bursts")
    p.add_argument("--burst-size", type=int, default=None, help="default: max-waiting + max-num-seqs + 8")
    p.add_argument("--invalid-rate", type=float, default=d.invalid_rate)
    p.add_argument("--long-rate", type=float, default=d.long_rate)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-require-chaos", action="store_true",
                   help="do not fail when no preemption, 503 or disconnect happened")
    g = p.add_argument_group("the server started here")
    g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-waiting", type=int, default=d.max_waiting)
    g.add_argument("--server-threads", type=int, default=d.server_threads, help="torch threads of the server")
    g.add_argument("--server-log", default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = SoakConfig(
        url=a.url, model=a.model, requests=a.requests, duration_s=a.duration, time_limit_s=a.time_limit,
        concurrency=a.concurrency, seed=a.seed, disconnect_rate=a.disconnect_rate, burst_every=a.burst_every,
        burst_size=a.burst_size, invalid_rate=a.invalid_rate, long_rate=a.long_rate,
        request_timeout_s=a.request_timeout, api_key=a.api_key,
        require_chaos=False if a.no_require_chaos else None, num_kv_blocks=a.num_kv_blocks,
        block_size=a.block_size, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_waiting=a.max_waiting, server_threads=a.server_threads, server_log=a.server_log, verbose=a.verbose,
    )
    result = run_soak(cfg)
    for failure in result.failures[:50]:
        print(f"soak: FAILED: {failure}", file=sys.stderr)
    if len(result.failures) > 50:
        print(f"soak: ... and {len(result.failures) - 50} more failures", file=sys.stderr)
    print(result.line(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
