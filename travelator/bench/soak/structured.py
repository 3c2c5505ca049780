"""Constrained requests of ``--everything``: a few JSON schemas, regexes and choice lists, the
request fields that ask for them (OpenAI's ``response_format`` and vLLM's
``structured_outputs``), and the check of a finished answer against its constraint."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

# Bounded strings, numbers and arrays: a small model rambles inside an unbounded string until
# max_tokens, and such an answer can only be counted as cut, not checked.
SCHEMAS: list[dict] = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object",
     "properties": {"animal": {"enum": ["cat", "dog", "bird"]}, "happy": {"type": "boolean"},
                    "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
     "required": ["animal", "happy", "toys"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
]
REGEXES = [r"(Lily|Ben|Tom) (is|was) [a-z]{1,8}\.", r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}"]
CHOICES = [["happy", "sad", "big", "small"], ["yes", "no"]]


@dataclass(frozen=True)
class Constraint:
    kind: str  # "json", "regex" or "choice"
    value: dict | str | list[str]

    def check(self, text: str) -> str | None:
        """None if ``text`` (a finished answer) satisfies the constraint, else what is wrong."""
        if self.kind == "json":
            import jsonschema  # the test extra brings it; only --everything needs it

            try:
                jsonschema.validate(json.loads(text), self.value)
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                return f"{text!r} is not valid against its schema: {str(exc).splitlines()[0]}"
            return None
        if self.kind == "regex":
            return None if re.fullmatch(self.value, text) else f"{text!r} does not match {self.value!r}"
        return None if text in self.value else f"{text!r} is none of {self.value}"


def pick(rng: random.Random) -> tuple[Constraint, dict]:
    """A constraint and the request fields that ask for it, in one of the API's spellings."""
    kind = rng.choice(["json", "json", "regex", "choice"])
    if kind == "json":
        schema = rng.choice(SCHEMAS)
        if rng.random() < 0.5:
            fields = {"response_format": {"type": "json_schema",
                                          "json_schema": {"name": "answer", "schema": schema}}}
        else:
            fields = {"structured_outputs": {"json": schema}}
        return Constraint("json", schema), fields
    if kind == "regex":
        pattern = rng.choice(REGEXES)
        return Constraint("regex", pattern), {"structured_outputs": {"regex": pattern}}
    options = rng.choice(CHOICES)
    return Constraint("choice", options), {"structured_outputs": {"choice": options}}
