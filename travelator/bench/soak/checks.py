"""The soak's checks: every answer (a valid completion or stream, stop strings honoured, usage
that adds up), and the server at rest (the engine's own accounting through /debug/engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from travelator.bench.soak.config import SoakConfig, SoakResult
from travelator.bench.soak.workload import Spec

VALID_FINISH = {"stop", "length"}


@dataclass(frozen=True)
class Answer:
    """What a completed request answered, per choice index."""

    texts: list[str]
    finishes: list[str]


class Outcome:
    COMPLETED, DISCONNECTED, REJECTED, INVALID, FAILED = "completed", "disconnected", "rejected", "invalid", "failed"
    KILLED = "killed"  # failed with the worker the soak killed (disaggregated servers)


def check_text(spec: Spec, text: str, finish: str, stop_reason) -> str | None:
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


def check_usage(spec: Spec, usage: dict | None, finishes: list[str]) -> str | None:
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


def validate_json(spec: Spec, data: dict) -> tuple[str | None, Answer | None]:
    chat = spec.path.endswith("chat/completions")
    want = "chat.completion" if chat else "text_completion"
    if data.get("object") != want:
        return f"object {data.get('object')!r}, expected {want}", None
    choices = data.get("choices")
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(spec.choices)):
        return f"choices {choices!r:.200} are not indices 0..{spec.choices - 1}", None
    texts, finishes = [], []
    for c in sorted(choices, key=lambda c: c["index"]):
        text = c["message"]["content"] if chat else c.get("text")
        problem = check_text(spec, text, c.get("finish_reason"), c.get("stop_reason"))
        if problem:
            return f"choice {c.get('index')}: {problem}", None
        texts.append(text)
        finishes.append(c["finish_reason"])
    return check_usage(spec, data.get("usage"), finishes), Answer(texts, finishes)


def validate_stream(spec: Spec, events: list[str], include_usage: bool) -> tuple[str | None, Answer | None]:
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE]: {events[-2:]!r}", None
    chat = spec.path.endswith("chat/completions")
    texts: dict[int, str] = {}
    finished: dict[int, tuple[str, object]] = {}
    usage = None
    for raw in events[:-1]:
        try:
            chunk = json.loads(raw)
        except json.JSONDecodeError:
            return f"an event is not JSON: {raw[:200]!r}", None
        if "error" in chunk:
            return f"error event: {chunk['error']}", None
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            i = c.get("index")
            if i in finished:
                return f"choice {i} got a chunk after its finish_reason", None
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            texts[i] = texts.get(i, "") + (piece or "")
            if c.get("finish_reason") is not None:
                finished[i] = (c["finish_reason"], c.get("stop_reason"))
    if sorted(finished) != list(range(spec.choices)):
        return f"finish reasons for choices {sorted(finished)}, expected 0..{spec.choices - 1}", None
    for i, (finish, stop_reason) in finished.items():
        problem = check_text(spec, texts.get(i, ""), finish, stop_reason)
        if problem:
            return f"choice {i}: {problem}", None
    answer = Answer([texts.get(i, "") for i in range(spec.choices)], [finished[i][0] for i in range(spec.choices)])
    if include_usage:
        return check_usage(spec, usage, answer.finishes), answer
    return None, answer


def judge_error(spec: Spec, status: int, raw: bytes):
    try:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"]
    except Exception:  # noqa: BLE001
        return Outcome.FAILED, f"error without an OpenAI error body: {raw[:200]!r}", status
    if status == 503 and err.get("code") == "queue_full":
        return Outcome.REJECTED, None, status
    if spec.invalid and 400 <= status < 500:
        return Outcome.INVALID, None, status
    return Outcome.FAILED, f"{err.get('code')}: {err['message'][:200]}", status


def at_rest_problems(report: dict) -> list[str]:
    """What the engine's self-check (``/debug/engine``) says is wrong once the server is idle."""
    kv, reqs = report["kv"], report["requests"]
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
    return [msg for ok, msg in checks if not ok]


def chaos_problems(cfg: SoakConfig, result: SoakResult, own_server: bool) -> list[str]:
    """The chaos must really have happened (on a server the soak started, by default), and no
    answer may be a 5xx other than 503."""
    problems = []
    require = cfg.require_chaos if cfg.require_chaos is not None else own_server
    if require and result.sent >= 100:
        if not result.preemptions:
            problems.append("no preemption happened: the KV pool was not under pressure")
        if cfg.burst_every and cfg.effective_burst_size and not result.rejected_503:
            problems.append("no burst was rejected with 503: the waiting-queue bound was never reached")
        if cfg.disconnect_rate > 0 and not result.disconnected:
            problems.append("no client disconnected")
    if require and cfg.everything and result.sent >= 100:
        problems += everything_problems(result)
    if cfg.kill_decode_worker_after is not None and result.sent > cfg.kill_decode_worker_after:
        if not result.killed_worker:
            problems.append("no decode worker was killed")
    if result.server_errors_5xx:
        problems.append(f"{result.server_errors_5xx} answers were 5xx other than 503 "
                        f"(statuses: {dict(result.statuses)})")
    return problems


def everything_problems(result: SoakResult) -> list[str]:
    """``--everything`` must have exercised what it claims to."""
    checks = [
        ("structured_outputs" in result.skipped or result.constrained_checked > 0,
         "no constrained answer finished to be checked"),
        (result.greedy_compared > 0, "no greedy answer was compared with the request alone"),
        (bool(result.prefix_hit_tokens), "the prefix cache never hit"),
        (bool(result.draft_tokens), "no draft token was verified: speculation never ran"),
        (len(result.priorities) > 1, "the requests did not differ in priority"),
    ]
    return [msg for ok, msg in checks if not ok]
