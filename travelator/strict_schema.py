"""Strict JSON schemas are closed: what ``strict: true`` means for an output constraint.

JSON Schema leaves an object open (``additionalProperties`` defaults to any value); OpenAI's
structured outputs treat a strict schema as closed, so that an answer holds the keys its
schema names and no others. ``close_objects`` gives a strict schema that meaning: every object
subschema that says neither ``additionalProperties`` nor ``unevaluatedProperties`` gets
``additionalProperties: false``. The branches of an ``allOf`` are left as they are: closing
each would refuse the keys the other branches name.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` with its object subschemas closed (see the module's docstring);
    the values under ``const``, ``enum``, ``default`` and ``examples`` are data and kept."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if _is_object(out) and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and "properties" in schema)
