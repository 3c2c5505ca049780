"""Structured outputs: what a request's output must match, as an llguidance grammar.

One of a JSON schema, any JSON object, a regular expression, a fixed list of choices, or a
Lark grammar (llguidance's dialect). The grammar is checked when the request is made, so a
bad schema or regex is a 400 naming the field, never a failed step. The model runner keeps
one llguidance matcher per constrained request: each step it masks the logits of those rows
to the tokens the grammar allows, and advances the matcher with the sampled token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance

from travelator.errors import InvalidRequestError
from travelator.json_grammar import JSON_OPTIONS, NumberLimits, Untranslatable, json_schema_lark

_DEFAULT_LIMITS = NumberLimits()


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    json: dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, as llguidance reads it
    # How long a number in a JSON output may be (json and json_object; see NumberLimits): a
    # small model otherwise writes digits until max_tokens.
    number_digits: int = _DEFAULT_LIMITS.digits
    exponent_digits: int = _DEFAULT_LIMITS.exponent_digits
    # The llguidance grammar (a JSON document), built and checked once, when the constraint is
    # made: every copy of the request's parameters and its matcher share it.
    grammar_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of json, json_object, regex, choice and grammar",
                                      "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                      "structured_outputs.choice")
        if self.json is not None and not _integers_fit(self.json):
            # A tensor-parallel engine sends the schema to every rank in 64-bit integers.
            raise InvalidRequestError("the schema holds an integer outside [-2^63, 2^64)", "structured_outputs.json")
        if self.number_digits < 1 or self.exponent_digits < 1:
            raise InvalidRequestError("number_digits and exponent_digits must be at least 1", "structured_outputs")
        # Raise InvalidRequestError when the schema, regex or grammar does not compile.
        text = ""
        try:
            text = self._build_grammar()
            error = llguidance.LLMatcher.validate_grammar(text)
        except (ValueError, TypeError, RuntimeError) as exc:
            error = str(exc)
        if error:
            raise InvalidRequestError(f"the {self.param.split('.')[-1]} constraint does not compile: {error}",
                                      self.param)
        object.__setattr__(self, "grammar_text", text)

    @property
    def param(self) -> str:
        """The field a client set, for error messages."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return f"structured_outputs.{name}"
        return "structured_outputs.json_object"

    def _build_grammar(self) -> str:
        if self.json is not None or self.json_object:
            return self._json_grammar(self.json if self.json is not None else {"type": "object"})
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals read JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


    def _json_grammar(self, schema: Any) -> str:
        """The schema's grammar with bounded numbers; llguidance's own (unbounded numbers)
        for a schema json_grammar cannot rewrite."""
        try:
            lark = json_schema_lark(schema, NumberLimits(self.number_digits, self.exponent_digits))
        except Untranslatable:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_lark(lark)


def _integers_fit(value: Any) -> bool:
    """Whether every integer in a JSON value fits 64 bits (signed, or unsigned above)."""
    if isinstance(value, dict):
        return all(_integers_fit(v) for v in value.values())
    if isinstance(value, list):
        return all(_integers_fit(v) for v in value)
    return not isinstance(value, int) or -(2**63) <= value < 2**64
