"""Relevance scores from a causal LM, as rerankers built on one do (Qwen3-Reranker): the query
and a document go into a prompt that asks a yes/no question, one prompt-only pass reads the
log-probability of each label token as the next token, and the score is the first label's
share of the labels' probability.

The query comes before the document in every prompt, so the prompts of one query's documents
share a prefix that the prefix cache computes once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from travelator.chat import render_chat
from travelator.model.tokenizer import Tokenizer

DEFAULT_INSTRUCTION = ('Judge whether the Document meets the requirements of the Query. '
                       'Answer only "yes" or "no".')
_FIELDS = re.compile(r"\{(query|document)\}")


@dataclass(frozen=True, slots=True)
class ScoreFormat:
    # The prompt as text with {query} and {document} in it, encoded as a completion prompt is
    # (the tokenizer's BOS added); None: the model's chat template, DEFAULT_INSTRUCTION as the
    # system message and the pair as the user's, the assistant's turn opened.
    template: str | None = None
    labels: tuple[str, ...] = ("yes", "no")  # the first is "relevant"

    def __post_init__(self) -> None:
        if not self.labels or not all(self.labels):
            raise ValueError("give at least one non-empty score label")
        if self.template is not None and "{document}" not in self.template:
            raise ValueError("a score template must hold {document} (and usually {query})")

    def prompt_token_ids(self, tokenizer: Tokenizer, query: str, document: str) -> list[int]:
        if self.template is not None:
            values = {"query": query, "document": document}
            return tokenizer.encode(_FIELDS.sub(lambda m: values[m.group(1)], self.template))
        messages = [{"role": "system", "content": DEFAULT_INSTRUCTION},
                    {"role": "user", "content": f"<Query>: {query}\n<Document>: {document}"}]
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def label_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """Each label's token; ValueError when a label is not exactly one token."""
        ids = []
        for label in self.labels:
            tokens = tokenizer.encode(label, add_special_tokens=False)
            if len(tokens) != 1:
                raise ValueError(f"the score label {label!r} is {len(tokens)} tokens for this "
                                 f"tokenizer; a label must be one token")
            ids.append(tokens[0])
        return tuple(ids)


def relevance(label_logprobs: list[float]) -> float:
    """The first label's probability among the labels' (its own probability when alone)."""
    top = max(label_logprobs)
    if len(label_logprobs) == 1 or top == -math.inf:
        return math.exp(label_logprobs[0])
    weights = [math.exp(lp - top) for lp in label_logprobs]
    return weights[0] / sum(weights)
