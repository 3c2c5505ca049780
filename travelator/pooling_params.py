"""What a prompt-only request returns instead of generated text: an embedding of its prompt, or
the log-probabilities of a few label tokens after it (scoring, reranking).

Such a request is a generation with ``max_tokens=0``: the scheduler chunks its prompt like any
other and drops the sample at the end; the model runner pools the final hidden states (the
last prompt token's, or the mean over every prompt token's) or reads the label tokens' log-
probabilities from the last row's logits, and the pooled values come back on the request's
output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from travelator.errors import InvalidRequestError

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    # "embed": the prompt's hidden states pooled into one vector; "score": the log-probability
    # of each of ``label_token_ids`` as the token after the prompt.
    task: str = "embed"
    pooling: str = "last"  # embed: the last prompt token's hidden state, or the mean of all
    normalize: bool = True  # embed: scaled to unit length (after any truncation)
    dimensions: int | None = None  # embed: the first this many dimensions only (Matryoshka)
    label_token_ids: tuple[int, ...] = ()  # score

    def __post_init__(self) -> None:
        if self.task not in ("embed", "score"):
            raise InvalidRequestError(f"task must be 'embed' or 'score', got {self.task!r}", "task")
        if self.pooling not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got "
                                      f"{self.pooling!r}", "pooling")
        if self.dimensions is not None and operator.index(self.dimensions) < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}", "dimensions")
        if self.task == "score":
            if not self.label_token_ids:
                raise InvalidRequestError("a score needs at least one label token", "label_token_ids")
            if any(operator.index(t) < 0 for t in self.label_token_ids):
                raise InvalidRequestError("label token ids must be non-negative", "label_token_ids")

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether every prompt token's hidden state is read, so none may come from the prefix
        cache (a cached block holds keys and values, not hidden states)."""
        return self.task == "embed" and self.pooling == "mean"
