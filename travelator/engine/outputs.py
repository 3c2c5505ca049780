"""What the engine hands back about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from travelator.engine.kv_handoff import KVHandoff
from travelator.engine.request import RequestTimes


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]
    rank: int | None = None  # in its distribution (1: most likely); known for prompt tokens


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # all output so far
    text: str  # all final output text so far
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""  # text released this step (stop-string-safe)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    times: RequestTimes | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    # With SamplingParams.pooling: the embedding, or each label token's logprob (finished only).
    pooled: list[float] | None = None
    # A request added with hand_off that finished its first token: its KV, for another
    # engine's add_handoff to continue it.
    handoff: KVHandoff | None = None
