"""JSON schemas as llguidance Lark grammars whose numbers have a bounded length.

llguidance's JSON-schema compiler lets a number take any count of digits and an exponent any
count of zeros (``-5.1000000…``, ``22.1e0000…``): a small model can write digits until
``max_tokens`` and never close its JSON. The compiler has no option to bound them, so a schema
is rewritten here as a Lark grammar: objects, arrays, ``anyOf``, type lists and ``$defs``
references become rules, numbers a bounded regex (with integer ``minimum``/``maximum``, a range
regex too, and no exponent), strings with ``minLength``/``maxLength`` a bounded repetition of
the characters free strings take, and every other subschema (strings with a ``pattern`` or a
``format``, ``enum``,
``const``, ``allOf``, ``oneOf``, ``multipleOf``, a number bound that is not an integer, ...)
stays a ``%json`` block that llguidance compiles as before. Every rewrite keeps a subset of the
schema's language (it only drops over-long numbers and, from an open object, extra keys that
need escapes or repeat a named one), so an output the grammar accepts validates against the
schema. A schema this cannot rewrite (a reference other than ``#/$defs/…``, an ``$id``, a
``false`` subschema, its own ``x-guidance``) is compiled whole by llguidance, unbounded.

Whitespace: ", " and ": " between items and after keys, none anywhere else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# llguidance's JSON options for the parts it compiles: the same fixed separators as the rules.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords that say nothing about which values are valid.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$defs", "definitions"})
_STRING = r'/"(\\(["\\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1F])*"/'
# One character of a string with minLength/maxLength, which count code points (as the JSON
# Schema spec, and jsonschema on the decoded string): an unescaped one (DEL included, as in
# free strings), an escape, or a surrogate pair written as two \u escapes; a lone surrogate,
# no character, is left out.
_STRING_CHAR = (r'\\(["\\/bfnrt]|u([0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
                r'|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}'
                r'|[^"\\\x00-\x1F]')
_PLAIN_KEY = r'/"[^"\\\x00-\x1F]*"/'  # an extra key: no escapes, so none can spell a named key
_MAX_ITEMS_UNROLLED = 1000  # a larger maxItems stays llguidance's


@dataclass(frozen=True, slots=True)
class NumberLimits:
    """How long a JSON number may be: ``digits`` written in its integer and fraction parts
    together (a lone leading 0 not counted; the integer part has no other leading zero), and
    ``exponent_digits`` in its exponent."""
    digits: int = 17  # as many as a float64 needs to round-trip
    exponent_digits: int = 3

    def __post_init__(self) -> None:
        if self.digits < 1 or self.exponent_digits < 1:
            raise ValueError("digits and exponent_digits must be at least 1")

    def number_regex(self) -> str:
        d = self.digits
        mantissas = [f"0(\\.[0-9]{{1,{d}}})?"]
        for k in range(1, d + 1):  # k digits before the point leave d - k after it
            fraction = f"(\\.[0-9]{{1,{d - k}}})?" if k < d else ""
            mantissas.append(f"[1-9][0-9]{{{k - 1}}}{fraction}")
        return f"-?({'|'.join(mantissas)})([eE][+-]?[0-9]{{1,{self.exponent_digits}}})?"


class Untranslatable(Exception):
    """The schema cannot be rewritten: llguidance compiles it as it is."""


def json_schema_lark(schema: Any, limits: NumberLimits) -> str:
    """``schema`` as an llguidance Lark grammar with bounded numbers; raises Untranslatable."""
    if not isinstance(schema, dict) or "x-guidance" in schema or not _refers_only_to_definitions(schema):
        raise Untranslatable
    return _Translator(schema, limits).grammar()


def _refers_only_to_definitions(node: Any) -> bool:
    """Whether every reference is to the root's ``$defs``/``definitions`` (and no ``$id`` or
    anchor moves them): those stay right inside a ``%json`` block that carries the
    definitions; ``#`` or ``#/properties/...`` would point into the block instead."""
    if isinstance(node, list):
        return all(_refers_only_to_definitions(v) for v in node)
    if not isinstance(node, dict):
        return True
    if {"$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef"} & set(node):
        return False
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/"))):
        return False
    return all(_refers_only_to_definitions(v) for v in node.values())


class _Translator:
    def __init__(self, root: dict[str, Any], limits: NumberLimits) -> None:
        self._defs = {key: root[key] for key in ("$defs", "definitions") if isinstance(root.get(key), dict)}
        self._root = root
        self._limits = limits
        self._rules: list[str] = []
        self._refs: dict[str, str] = {}  # a $ref -> its rule
        self._any: str | None = None

    def grammar(self) -> str:
        start = self.expr(self._root)
        terminals = [f"NUM: {_regex(self._limits.number_regex())}", f"STR: {_STRING}", f"PLAIN_KEY: {_PLAIN_KEY}"]
        return "\n".join([f"start: {start}", *self._rules, *terminals]) + "\n"

    def _rule(self, body: str) -> str:
        name = f"r{len(self._rules)}"
        self._rules.append(f"{name}: {body}")
        return name

    def _reserve(self) -> int:
        self._rules.append("")
        return len(self._rules) - 1

    def expr(self, schema: Any) -> str:
        """A Lark expression for the values valid under ``schema`` (a subset of them)."""
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise Untranslatable  # false, or not a schema: llguidance says which
        keys = set(schema) - _ANNOTATIONS
        if keys <= {"anyOf"} and isinstance(schema.get("anyOf"), list) and schema["anyOf"]:
            return "(" + " | ".join(self.expr(s) for s in schema["anyOf"]) + ")"
        if keys == {"$ref"}:
            return self._ref(schema["$ref"])
        if not keys:
            return self.any_value()
        kind = schema.get("type")
        if isinstance(kind, list) and kind and keys & {"enum", "const"} == set():
            return "(" + " | ".join(self.expr({**schema, "type": k}) for k in kind) + ")"
        build = {"object": self._object, "array": self._array, "integer": self._integer,
                 "number": self._number, "string": self._string, "boolean": self._boolean,
                 "null": self._null}.get(kind) if isinstance(kind, str) else None
        return (build(schema, keys) if build else None) or self._embedded(schema)

    def _embedded(self, schema: dict[str, Any]) -> str:
        """llguidance's own grammar for ``schema``, with the root's definitions it may use."""
        return "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **self._defs, **schema}, ensure_ascii=False)

    def _ref(self, ref: Any) -> str:
        if ref in self._refs:
            return self._refs[ref]
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix) and "/" not in ref[len(prefix):]:
                target = self._defs.get(prefix[2:-1], {}).get(ref[len(prefix):].replace("~1", "/").replace("~0", "~"))
                if target is not None:
                    slot = self._reserve()  # named before its body: a definition may refer to itself
                    name = self._refs[ref] = f"r{slot}"
                    self._rules[slot] = f"{name}: {self.expr(target)}"
                    return name
        raise Untranslatable

    def any_value(self) -> str:
        """Any JSON value (with bounded numbers)."""
        if self._any is None:
            slot = self._reserve()
            self._any = f"r{slot}"
            pair = f"STR {_lit(': ')} {self._any}"
            obj = self._rule(f"{_lit('{')} ({pair} ({_lit(', ')} {pair})*)? {_lit('}')}")
            arr = self._rule(f"{_lit('[')} ({self._any} ({_lit(', ')} {self._any})*)? {_lit(']')}")
            self._rules[slot] = f"{self._any}: {obj} | {arr} | STR | NUM | {_lit('true')} | {_lit('false')} | {_lit('null')}"
        return self._any

    def _object(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        props, required = schema.get("properties", {}), schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if (not keys <= {"type", "properties", "required", "additionalProperties"} or not isinstance(props, dict)
                or not isinstance(required, list) or not set(required) <= set(props)):
            return None
        named = [(_lit(json.dumps(name, ensure_ascii=False) + ": ") + " " + self.expr(sub), name in required)
                 for name, sub in props.items()]
        extra_pair = None
        if extra is not False:
            key = self._extra_key(props) if props else "STR"
            extra_pair = f"{key} {_lit(': ')} {self.expr(extra)}"
        return f"{_lit('{')} {self._members(named, extra_pair)} {_lit('}')}"

    def _extra_key(self, props: dict[str, Any]) -> str:
        """A key no property names (written without escapes, so none spells one)."""
        taken = " | ".join(_lit(json.dumps(name, ensure_ascii=False)) for name in props)
        terminal = f"KEY{len(self._rules)}"
        self._rules.append(f"{terminal}: PLAIN_KEY & ~({taken})")
        return terminal

    def _members(self, named: list[tuple[str, bool]], extra_pair: str | None) -> str:
        """The members in order: required ones always, optional ones or not, extra ones last;
        ", " between any two. Two rules per property: before any member, and after one."""
        sep = _lit(", ")
        first = self._rule(f"({extra_pair} ({sep} {extra_pair})*)?" if extra_pair else "")
        rest = self._rule(f"({sep} {extra_pair})*" if extra_pair else "")
        for pair, required in reversed(named):
            first, rest = (self._rule(f"{pair} {rest}" + ("" if required else f" | {first}")),
                           self._rule(f"{sep} {pair} {rest}" + ("" if required else f" | {rest}")))
        return first

    def _array(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        prefix, items = schema.get("prefixItems", []), schema.get("items", True)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if items is False and isinstance(prefix, list):
            high = len(prefix) if high is None else min(high, len(prefix))
        if (not keys <= {"type", "prefixItems", "items", "minItems", "maxItems"} or not isinstance(prefix, list)
                or isinstance(items, list) or not _count(low)
                or not (high is None or _count(high) and low <= high <= _MAX_ITEMS_UNROLLED)):
            return None
        if high == 0:
            return _lit("[]")
        sep = _lit(", ")
        if not prefix:
            item = self.expr(items)
            body = f"{item} {_repeat(f'{sep} {item}', max(low - 1, 0), None if high is None else high - 1)}"
            return f"{_lit('[')} {body if low else f'({body})?'} {_lit(']')}"
        # From the last element back: the items after the prefix (each after a separator),
        # then the prefix's own, optional from index minItems on.
        after = ""
        if high is None or high > len(prefix):
            after = _repeat(f"{sep} {self.expr(items)}", max(low - len(prefix), 0),
                            None if high is None else high - len(prefix))
        for i in reversed(range(min(len(prefix), high or len(prefix)))):
            element = ("" if i == 0 else f"{sep} ") + f"{self.expr(prefix[i])} {after}"
            after = element if i < low else f"({element})?"
        return f"{_lit('[')} {after} {_lit(']')}"

    def _integer(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
        if not keys <= {"type"} | bounds or not all(_finite(schema[k]) for k in keys & bounds):
            return None
        low, high = _integer_bounds(schema)
        if low is None and high is None:
            return self._terminal(f"-?(0|[1-9][0-9]{{0,{self._limits.digits - 1}}})")
        digits = max(self._limits.digits, *(len(str(abs(b))) for b in (low, high) if b is not None))
        widest = 10**digits - 1
        low, high = (-widest if low is None else low), (widest if high is None else high)
        return self._terminal(integer_range_regex(low, high)) if low <= high else None

    def _number(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        """Without an exponent where the schema has bounds; those must be integers."""
        bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
        if not keys <= {"type"} | bounds or not all(_finite(schema[k]) and schema[k] == int(schema[k])
                                                   for k in keys & bounds):
            return None
        if keys <= {"type"}:
            return "NUM"
        low, high = _number_bounds(schema)
        digits = max(self._limits.digits, *(len(str(abs(b[0]))) for b in (low, high) if b is not None))
        widest = (10**digits - 1, True)
        ranged = decimal_range_regex(low, high, widest)
        if ranged is None:
            return None  # empty: llguidance says so
        limits = NumberLimits(digits, self._limits.exponent_digits)
        name = f"NUM{len(self._rules)}"
        self._rules.append(f"{name}: {_regex(ranged)} & {_regex(limits.number_regex())}")
        return name

    def _string(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        if keys <= {"type"}:
            return "STR"
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not keys <= {"type", "minLength", "maxLength"} or not _count(low) or not (
                high is None or _count(high) and low <= high):
            return None  # a pattern or format, or bounds that are not counts: llguidance's
        return self._terminal(f'"({_STRING_CHAR}){{{low},{"" if high is None else high}}}"')

    def _boolean(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        return f"({_lit('true')} | {_lit('false')})" if keys <= {"type"} else None

    def _null(self, schema: dict[str, Any], keys: set[str]) -> str | None:
        return _lit("null") if keys <= {"type"} else None

    def _terminal(self, regex: str) -> str:
        name = f"INT{len(self._rules)}"
        self._rules.append(f"{name}: {_regex(regex)}")
        return name


def _repeat(body: str, low: int, high: int | None) -> str:
    """``body`` from ``low`` to ``high`` times (None: no bound) in Lark; nothing for at most 0
    (Lark refuses a range that ends at 0)."""
    if high == 0:
        return ""
    return f"({body}){{{low},{'' if high is None else high}}}"


def _lit(text: str) -> str:
    """A Lark string literal (Lark reads JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _regex(regex: str) -> str:
    return "/" + regex.replace("/", "\\/") + "/"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: Any) -> bool:
    # A bound past 10^40 stays llguidance's: its regex would be as long as the bound.
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and abs(value) < 1e40


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and largest integers the schema's bounds allow (None: unbounded)."""
    lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
    lows += [math.floor(schema["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in schema else []
    highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
    highs += [math.ceil(schema["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in schema else []
    return max(lows, default=None), min(highs, default=None)


def _number_bounds(schema: dict[str, Any]) -> tuple[tuple[int, bool] | None, tuple[int, bool] | None]:
    """The schema's lowest and highest bounds (integers) and whether each is allowed."""
    lows = [(int(schema[k]), k == "minimum") for k in ("minimum", "exclusiveMinimum") if k in schema]
    highs = [(int(schema[k]), k == "maximum") for k in ("maximum", "exclusiveMaximum") if k in schema]
    # The tighter of two bounds at one value is the exclusive one.
    low = max(lows, key=lambda b: (b[0], not b[1]), default=None)
    high = min(highs, key=lambda b: (b[0], b[1]), default=None)
    return low, high


def decimal_range_regex(low: tuple[int, bool] | None, high: tuple[int, bool] | None,
                        widest: tuple[int, bool]) -> str | None:
    """A regex for the decimals ``-?I(.F)?`` between integer bounds (value, allowed), None
    for no bound (then ``widest`` or its negation); None when no decimal is between them."""
    high_or_widest = high or widest
    low_or_widest = low or (-widest[0], widest[1])
    parts = []
    if high_or_widest[0] >= 0:  # x >= 0: its magnitude between max(low, 0) and high
        start = low_or_widest if low_or_widest[0] >= 0 else (0, True)
        parts.append(_magnitude_range(start, high_or_widest))
    if low_or_widest[0] < 0:  # x < 0: its magnitude between max(-high, 0) (never 0) and -low
        start = (-high_or_widest[0], high_or_widest[1]) if high_or_widest[0] < 0 else (0, False)
        magnitudes = _magnitude_range(start, (-low_or_widest[0], low_or_widest[1]))
        parts.append(magnitudes and "-" + magnitudes)
    parts = [p for p in parts if p]
    return "(" + "|".join(parts) + ")" if parts else None


def _magnitude_range(low: tuple[int, bool], high: tuple[int, bool]) -> str | None:
    """A regex for the decimals ``I(.F)?`` from ``low`` to ``high`` (0 <= values; each with
    whether it is allowed), None when none is between them."""
    (a, a_allowed), (b, b_allowed) = low, high
    if a > b or (a == b and not (a_allowed and b_allowed)):
        return None
    if a == b:
        return f"{a}(\\.0+)?"
    parts = [f"{a}(\\.[0-9]+)?" if a_allowed else f"{a}\\.[0-9]*[1-9][0-9]*"]
    if b - a > 1:
        parts.append(f"{_natural_range(a + 1, b - 1)}(\\.[0-9]+)?")
    if b_allowed:
        parts.append(f"{b}(\\.0+)?")
    return "(" + "|".join(parts) + ")"


def integer_range_regex(low: int, high: int) -> str:
    """A regex for the JSON integers in [low, high] (``-0`` left out)."""
    parts = []
    if high >= 0:
        parts.append(_natural_range(max(low, 0), high))
    if low < 0:
        parts.append("-" + _natural_range(max(1, -high), -low))
    return "(" + "|".join(parts) + ")"


def _natural_range(low: int, high: int) -> str:
    """A regex for the decimal numbers in [low, high], 0 <= low <= high, no leading zeros."""
    parts = []
    for width in range(len(str(low)), len(str(high)) + 1):
        first = low if width == len(str(low)) else 10 ** (width - 1)
        last = high if width == len(str(high)) else 10**width - 1
        parts.append(_same_width_range(str(first), str(last)))
    return "(" + "|".join(parts) + ")"


def _same_width_range(low: str, high: str) -> str:
    """A regex for the digit strings of one width from ``low`` to ``high``."""
    if not low:
        return ""
    rest = len(low) - 1
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return f"[{low[0]}-{high[0]}][0-9]{{{rest}}}"
    if low[0] == high[0]:
        return low[0] + _same_width_range(low[1:], high[1:])
    parts = [low[0] + _same_width_range(low[1:], "9" * rest)]
    if int(high[0]) - int(low[0]) > 1:
        parts.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}][0-9]{{{rest}}}")
    parts.append(high[0] + _same_width_range("0" * rest, high[1:]))
    return "(" + "|".join(parts) + ")"
