"""The contract between the scheduler and the model runner: what to compute in one step
(``SchedulerOutput``) and what the step produced (``RunnerOutput``).

Requests the runner has not seen (or that were preempted and dropped) come in full;
requests it already holds come as small changes, so a step description stays small
however long the sequences grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from travelator.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when a preempted request resumes
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class ScheduledDrafts:
    """The drafts one request verifies this step: the scheduler's proposal (n-gram lookup),
    or, with a draft model, none listed: the runner's draft model proposes ``num_tokens``."""

    num_tokens: int
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Batch order: request id -> number of tokens to compute this step.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests the runner must forget (finished, aborted or preempted since last step).
    freed_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0
    num_decodes: int = 0  # requests computing their last sampled token (and drafts, if any)
    num_prefill_tokens: int = 0  # tokens of prompts, or of outputs being recomputed
    prefill_request_ids: list[str] = field(default_factory=list)  # those computing such tokens
    # Speculative decoding: request id -> the drafts it verifies after its last sampled token
    # (counted in its num_scheduled_tokens).
    drafts: dict[str, ScheduledDrafts] = field(default_factory=dict)

    def num_drafts(self, request_id: str) -> int:
        drafts = self.drafts.get(request_id)
        return drafts.num_tokens if drafts is not None else 0

    @property
    def num_draft_tokens(self) -> int:
        return sum(d.num_tokens for d in self.drafts.values())

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens ``first .. first + len(logprobs) - 1`` (a prompt
    token's index; index 0 has none), each with its top alternatives when asked for."""

    first: int
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    ranks: list[int]  # each token's rank in its distribution (1: the most likely)


@dataclass(slots=True)
class RunnerOutput:
    """What one step of the model returns to the scheduler."""

    # Request id -> the tokens it kept this step, in order: its sample, or under speculative
    # decoding the drafts its own samples agreed with and then its own sample. Only requests
    # whose scheduled tokens reached the end of their known tokens: a prompt chunk that stops
    # short samples nothing. Whether a request stops among them is not decided here.
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # Request id -> the prompt logprobs this step computed, for requests that asked for them.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Request id -> why it cannot go on (its sampled token broke its grammar): the engine
    # ends these requests with an error; the others of the step go on.
    failed: dict[str, str] = field(default_factory=dict)
    # Request id -> its pooled values (an embedding, or label logprobs) once its prompt is done.
    pooled: dict[str, list[float]] = field(default_factory=dict)

    def tokens_of(self, request_id: str) -> list[SampledToken]:
        """Every token ``request_id`` got this step, in order (none: a prompt chunk)."""
        return self.sampled.get(request_id, [])
