"""What the engine counts: per step (``StepStats``) and since it started (``EngineCounters``).
Plain data, read by the metrics, the dashboard and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepStats:
    """What one step did, for metrics and occupancy plots."""

    num_requests: int
    num_tokens: int
    num_prefill_tokens: int
    num_decodes: int
    num_preempted: int
    num_running: int
    num_waiting: int
    kv_usage: float
    duration_s: float
    # Speculative decoding: drafts verified, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_speculating: int = 0  # requests that verified drafts


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once)
    computed_prompt_tokens: int = 0  # prompt tokens actually computed (recompute included)
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: draft tokens verified, how many were accepted, and the
    # request-steps that verified drafts (accepted / those: mean accepted length).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    speculative_steps: int = 0
