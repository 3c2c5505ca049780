"""What the tensor-parallel driver and its workers say to each other, and nothing else.

After rendezvous the driver sends a ``TPWorkerSpec``; then each message is a call of one
``Worker`` method of ``CALLS`` with its arguments, and for a call that replies, every
rank's result is gathered on the driver. Each is encoded by ``control_codec`` against the
types declared here: a worker refuses a method outside ``CALLS`` or arguments of other
types, the driver a reply of another type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from travelator.config import ModelConfig
from travelator.engine.control_codec import Codec, RefusedMessage, unpack
from travelator.engine.model_runner import RunnerSettings
from travelator.engine.scheduler_output import CachedRequestData, NewRequestData, ScheduledDrafts, SchedulerOutput
from travelator.pooling_params import PoolingParams
from travelator.sampling_params import SamplingParams, StopLimits
from travelator.structured import StructuredOutput


@dataclass(slots=True)
class TPWorkerSpec:
    """What a worker needs to build its shard; sent by the driver once, after rendezvous."""

    model: ModelConfig
    settings: RunnerSettings  # the driver's: each rank runs on its own device of this type
    expert_parallel: bool = False  # ParallelConfig's
    pipeline: bool = False  # the group's ranks are pipeline stages, not tensor-parallel shards

    @property
    def device_type(self) -> str:
        return self.settings.device.type

    def on(self, device: torch.device) -> RunnerSettings:
        return dataclasses.replace(self.settings, device=device)


class Call(NamedTuple):
    """A ``Worker`` method the driver may call: its argument types, and its result's type
    when every rank's result is gathered on the driver (``reply``)."""

    args: tuple[Any, ...]
    result: Any = type(None)
    reply: bool = True


STOP = "stop"  # the last message: the worker leaves its loop

CALLS: dict[str, Call] = {
    "step": Call((SchedulerOutput, list[tuple[str, int]]), reply=False),
    "allocate_kv_cache": Call((int, int)),
    "memory": Call((), dict[str, int]),
    "held_request_ids": Call((), set[str]),
    STOP: Call((), reply=False),
}

_CODEC = Codec([TPWorkerSpec, ModelConfig, RunnerSettings, SchedulerOutput, NewRequestData,
                CachedRequestData, ScheduledDrafts, SamplingParams, StopLimits, StructuredOutput,
                PoolingParams])
_ARGS = {method: tuple[call.args] if call.args else tuple[()] for method, call in CALLS.items()}


def encode_spec(spec: TPWorkerSpec) -> bytes:
    return _CODEC.encode(spec, TPWorkerSpec)


def decode_spec(data: bytes) -> TPWorkerSpec:
    return _CODEC.decode(data, TPWorkerSpec)


def encode_call(method: str, args: tuple[Any, ...]) -> bytes:
    return _CODEC.encode([method, args], tuple[str, _ARGS[method]])


def decode_call(data: bytes) -> tuple[str, tuple[Any, ...]]:
    """The method and its arguments; a method outside ``CALLS`` is refused before its
    arguments are read."""
    raw = unpack(data)
    if type(raw) is not list or len(raw) != 2 or type(raw[0]) is not str:
        raise RefusedMessage("expected a call: [method, arguments]")
    method = raw[0]
    if method not in CALLS:
        raise RefusedMessage(f"{method!r:.60} is not a method the driver may call")
    return method, _CODEC.check(raw[1], _ARGS[method])


def encode_result(method: str, result: Any) -> bytes:
    return _CODEC.encode(result, CALLS[method].result)


def decode_result(method: str, data: bytes) -> Any:
    return _CODEC.decode(data, CALLS[method].result)
