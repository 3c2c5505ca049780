"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields, replace

from travelator.errors import InvalidRequestError
from travelator.pooling_params import PoolingParams
from travelator.structured import StructuredOutput

_GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class StopLimits:
    """Bounds on a request's stop conditions. Stop strings become an automaton the step thread
    builds (once per set, at a cost that grows with their total length) and stop tokens are
    looked up at every token, so unbounded lists would slow every request in the batch.
    OpenAI allows 4 stop strings; 64 of 256 characters leave room for evaluation harnesses and
    agents while an automaton stays at most 16 K characters."""

    max_stop_strings: int = 64
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64

    def validate(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be at least 1, got {getattr(self, f.name)}")


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy decoding. ``max_tokens=None`` means "up to the
    model's context length". ``seed`` makes a sampled request reproducible whatever
    else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs to return per sampled token
    # Log-probability of every prompt token after the first, with this many top alternatives
    # (0: the token's own only); None: not computed. Prompts asking for it skip the prefix
    # cache (a cached prefix has no logits), and only their rows pay for the LM head.
    prompt_logprobs: int | None = None
    # The output must match this (JSON schema, regex, choice, grammar; checked when it is
    # made); it ends with EOS as soon as the grammar is complete, even with ignore_eos.
    structured: StructuredOutput | None = None
    # Speculative decoding (when the engine has it on): False keeps this request out of it.
    speculate: bool = True
    skip_special_tokens: bool = True
    # Bounds on stop and stop_token_ids (the server passes its own, see ServerSettings).
    stop_limits: StopLimits = StopLimits()
    # An embedding or a score of the prompt instead of generated text (max_tokens must be 0).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self._take_integers()
        if self.top_k < 0:
            self.top_k = 0
        self.validate()

    def _take_integers(self) -> None:
        """Integer fields as Python ints (a numpy integer or a bool is one), within the bounds
        every rank's messages carry (csrc and msgpack take 64-bit integers): InvalidRequestError
        naming the field otherwise."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _integer(value, name, _SEED_RANGE if name == "seed" else _COUNT_RANGE))
        self.stop_token_ids = [_integer(t, "stop_token_ids", _COUNT_RANGE) for t in self.stop_token_ids]

    def validate(self) -> None:
        """Raises InvalidRequestError naming the field at fault."""
        for name in _FLOAT_FIELDS:
            # NaN passes every range check below (comparisons with it are false).
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number, got {getattr(self, name)}", name)
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}", "n")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
                "repetition_penalty")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                "frequency_penalty")
        # 0: compute the prompt only (its prompt_logprobs, for scoring), generate nothing.
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be non-negative, got {self.max_tokens}",
                                      "max_tokens")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be non-negative, got {self.min_tokens}",
                                      "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must not exceed max_tokens", "min_tokens")
        if self.min_tokens and self.structured is not None:
            # A complete grammar allows only EOS, which min_tokens forbids: nothing is left.
            raise InvalidRequestError("min_tokens cannot be combined with a structured-output constraint",
                                      "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                                      "prompt_logprobs")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative", "stop_token_ids")
        self._validate_stop_bounds()
        if self.pooling is not None and (self.max_tokens != 0 or self.n != 1 or self.structured is not None):
            raise InvalidRequestError("a pooling request computes its prompt only: max_tokens=0, n=1, "
                                      "no structured output", "pooling")

    def _validate_stop_bounds(self) -> None:
        limits = self.stop_limits
        if len(self.stop) > limits.max_stop_strings:
            raise InvalidRequestError(f"stop has {len(self.stop)} strings, more than the limit of "
                                      f"{limits.max_stop_strings}", "stop")
        longest = max(map(len, self.stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise InvalidRequestError(f"a stop string has {longest} characters, more than the limit of "
                                      f"{limits.max_stop_string_chars}", "stop")
        if len(self.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequestError(f"stop_token_ids has {len(self.stop_token_ids)} ids, more than the "
                                      f"limit of {limits.max_stop_token_ids}", "stop_token_ids")

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of ``n``: one sample, with its own seed (``seed +
        index``), so that the choices differ but each stays reproducible."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > _SEED_RANGE[1]:
            seed -= 1 << 64  # the same 64 bits
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether the request reads something of every prompt token (its logprobs, or its
        hidden state for a mean), so no prompt token may come from the prefix cache."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.needs_every_prompt_row)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


# Every float field, each checked to be finite (annotations are strings here).
_FLOAT_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type == "float")
_INT_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type in ("int", "int | None"))
_COUNT_RANGE = (-(2**31), 2**31 - 1)  # counts, token ids, top-k: far past any model's
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what the API takes as a seed


def _integer(value: object, name: str, bounds: tuple[int, int]) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name) from None
    if not bounds[0] <= number <= bounds[1]:
        raise InvalidRequestError(f"{name} must be in [{bounds[0]}, {bounds[1]}]", name)
    return number
