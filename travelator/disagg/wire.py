"""The messages of a disaggregated server as they cross hosts: msgpack of allow-listed types
(``engine/control_codec.py``), never pickles, so that reading one runs no code.

A message is ``[kind, value]``: ``kind`` names one of the types a side may send, and the
reader checks the value against that type alone. The front end sends a worker its
``DisaggWorkerSpec`` once, then commands; a worker sends who it is (``WorkerId``) once, then
its events. ``RequestOutput`` travels as ``WireOutput`` (the codec takes string keys and one
type per value: top logprobs become pairs, the stop reason two fields; a hand-off's KV never
travels here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from travelator.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig, ParallelConfig, SchedulerConfig
from travelator.disagg import messages as m
from travelator.disagg.worker import DisaggWorkerSpec
from travelator.engine.control_codec import Codec, RefusedMessage, unpack
from travelator.engine.outputs import RequestOutput, TokenLogprob
from travelator.engine.request import RequestTimes
from travelator.engine.step_stats import StepStats
from travelator.pooling_params import PoolingParams
from travelator.sampling_params import SamplingParams, StopLimits
from travelator.structured import StructuredOutput


@dataclass(slots=True)
class WireLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    rank: int | None


@dataclass(slots=True)
class WireOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[WireLogprob]
    finished: bool
    finish_reason: str | None
    stop_token: int | None
    stop_string: str | None
    num_cached_tokens: int
    num_preemptions: int
    times: RequestTimes | None
    prompt_logprobs: list[WireLogprob | None] | None
    error: str | None
    pooled: list[float] | None


@dataclass(slots=True)
class WireReport:
    """``messages.Report`` with its outputs as ``WireOutput``."""

    worker: m.WorkerId
    outputs: list[WireOutput]
    stats: m.WorkerStats
    handed_off: list[str]
    admitted: list[str]
    failed: dict[str, str]
    lost_peers: list[int]
    step: StepStats | None
    clock: float


STOP_KIND = "stop"
COMMANDS: dict[str, Any] = {"Submit": m.Submit, "Expect": m.Expect, "Abort": m.Abort, "Forget": m.Forget,
                            "Check": m.Check}
EVENTS: dict[str, Any] = {"Ready": m.Ready, "WireReport": WireReport, "CheckReport": m.CheckReport, "Died": m.Died}

_CODEC = Codec([
    m.WorkerId, m.Submit, m.Expect, m.Abort, m.Forget, m.Check, m.Ready, m.WorkerStats, m.CheckReport, m.Died,
    WireReport, WireOutput, WireLogprob, RequestTimes, StepStats, DisaggWorkerSpec, EngineConfig, ModelConfig,
    CacheConfig, KVEventsConfig, SchedulerConfig, ParallelConfig, SamplingParams, StopLimits, StructuredOutput,
    PoolingParams])


def _encode(kinds: dict[str, Any], value: Any) -> bytes:
    kind = type(value).__name__
    return _CODEC.encode([kind, value], tuple[str, kinds[kind]])


def _decode(kinds: dict[str, Any], raw: Any) -> Any:
    if type(raw) is not list or len(raw) != 2 or raw[0] not in kinds:
        raise RefusedMessage(f"expected one of {sorted(kinds)}, got {str(raw)[:60]}")
    return _CODEC.check(raw[1], kinds[raw[0]])


def encode_command(cmd: Any) -> bytes:
    if cmd == m.STOP:
        return _CODEC.encode([STOP_KIND, None], tuple[str, type(None)])
    return _encode(COMMANDS, cmd)


def decode_command(data: bytes) -> Any:
    raw = unpack(data)
    if raw == [STOP_KIND, None]:
        return m.STOP
    return _decode(COMMANDS, raw)


def encode_event(event: Any) -> bytes:
    if isinstance(event, m.Report):
        event = _report_to_wire(event)
    return _encode(EVENTS, event)


def decode_event(data: bytes) -> Any:
    event = _decode(EVENTS, unpack(data))
    return _report_from_wire(event) if isinstance(event, WireReport) else event


def encode_spec(spec: DisaggWorkerSpec) -> bytes:
    return _CODEC.encode(spec, DisaggWorkerSpec)


def decode_spec(data: bytes) -> DisaggWorkerSpec:
    return _CODEC.decode(data, DisaggWorkerSpec)


def encode_hello(worker: m.WorkerId) -> bytes:
    return _CODEC.encode(worker, m.WorkerId)


def decode_hello(data: bytes) -> m.WorkerId:
    worker = _CODEC.decode(data, m.WorkerId)
    if worker.role not in (m.PREFILL, m.DECODE):
        raise RefusedMessage(f"not a worker role: {worker.role!r:.40}")
    return worker


# ---- outputs ----------------------------------------------------------------------------------
def _logprob_to_wire(lp: TokenLogprob) -> WireLogprob:
    return WireLogprob(lp.token_id, lp.logprob, list(lp.top_logprobs.items()), lp.rank)


def _logprob_from_wire(lp: WireLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, dict(lp.top_logprobs), lp.rank)


def _output_to_wire(out: RequestOutput) -> WireOutput:
    if out.handoff is not None:
        raise ValueError("a hand-off's KV moves over gloo, not with the outputs")
    reason = out.stop_reason
    prompt = None if out.prompt_logprobs is None else [
        None if lp is None else _logprob_to_wire(lp) for lp in out.prompt_logprobs]
    return WireOutput(
        out.request_id, out.prompt_token_ids, out.output_token_ids, out.text, out.new_token_ids, out.new_text,
        [_logprob_to_wire(lp) for lp in out.new_logprobs], out.finished, out.finish_reason,
        reason if type(reason) is int else None, reason if type(reason) is str else None,
        out.num_cached_tokens, out.num_preemptions, out.times, prompt, out.error, out.pooled)


def _output_from_wire(w: WireOutput) -> RequestOutput:
    prompt = None if w.prompt_logprobs is None else [
        None if lp is None else _logprob_from_wire(lp) for lp in w.prompt_logprobs]
    return RequestOutput(
        w.request_id, w.prompt_token_ids, w.output_token_ids, w.text, w.new_token_ids, w.new_text,
        [_logprob_from_wire(lp) for lp in w.new_logprobs], w.finished, w.finish_reason,
        w.stop_token if w.stop_token is not None else w.stop_string, w.num_cached_tokens, w.num_preemptions,
        w.times, prompt, w.error, w.pooled)


def _report_to_wire(rep: m.Report) -> WireReport:
    values = {f.name: getattr(rep, f.name) for f in dataclasses.fields(m.Report)}
    values["outputs"] = [_output_to_wire(o) for o in rep.outputs]
    return WireReport(**values)


def _report_from_wire(w: WireReport) -> m.Report:
    values = {f.name: getattr(w, f.name) for f in dataclasses.fields(WireReport)}
    values["outputs"] = [_output_from_wire(o) for o in w.outputs]
    return m.Report(**values)
