"""The grammars of JSON constraints (json_grammar.py, strict_schema.py), driven byte by byte
through llguidance with a byte-level tokenizer:

- sound: random walks through a grammar give texts that ``json.loads`` reads and
  ``jsonschema`` validates against the schema (the JSON Schema spec, not the grammar), with
  every number within the bound and no whitespace but the ", " and ": " separators;
- not too narrow: instances hypothesis-jsonschema draws from the schema, written with those
  separators in the schema's property order, are accepted when their numbers are in bounds
  (and, under a minimum or maximum, have no exponent);
- numbers: the bounded regex against hand-picked numbers; integer ranges against Python's
  comparisons;
- strict schemas closed, loose ones open.
"""

from __future__ import annotations

import copy
import json
import random
import re
from fractions import Fraction

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from travelator.json_grammar import NumberLimits, decimal_range_regex, integer_range_regex
from travelator.strict_schema import close_objects
from travelator.structured import StructuredOutput

POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
         "required": ["x", "y"], "additionalProperties": False}
SCHEMAS = [
    POINT,
    {"type": "object"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -7, "exclusiveMaximum": 130},
                                      "tag": {"type": "string", "maxLength": 4}, "on": {"type": "boolean"}},
     "required": ["on"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}, "additionalProperties": {"type": "number"}},
    {"$defs": {"Point": POINT}, "type": "object", "properties": {
        "points": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 3},
        "error": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
     "required": ["points", "error"], "additionalProperties": False},
    {"type": ["number", "string", "null"]},
    {"type": "array", "items": {"enum": [1.5, "a", None]}},
    {"type": "object", "properties": {"w": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["w"]},
    {"type": "object", "properties": {'a"b': {"type": "integer"}, "é ü": {"type": "number"}, "\n": {"type": "null"},
                                      "id": {"type": "boolean"}}, "required": ['a"b', "\n"]},
]
PAIR = {"type": "array", "prefixItems": [{"type": "number"}, {"type": "integer", "minimum": 0}], "items": False,
        "minItems": 2}
TUPLE = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}], "minItems": 1, "maxItems": 4}
# hypothesis-jsonschema draws neither from recursive schemas nor by prefixItems: walked only.
WALKED_ONLY = [PAIR, TUPLE,
    {"$defs": {"Tree": {"type": "object", "properties": {"v": {"type": "integer", "maximum": -2},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"},
                                                                  "maxItems": 2}},
                        "required": ["v", "kids"], "additionalProperties": False}},
     "$ref": "#/$defs/Tree"},
    # "#" is the root: compiled whole by llguidance (a %json block would take it for itself).
    {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"allOf": [{"$ref": "#"}]}, {"type": "null"}]}},
     "required": ["v", "next"], "additionalProperties": False},
]


def _byte_tokenizer() -> tuple[Tokenizer, llguidance.LLTokenizer, int]:
    """A tokenizer whose tokens are the 256 bytes (byte-level BPE without merges), and EOS."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    eos = vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=len(vocab), eos_token=[eos]), eos


TOKENIZER, LLTOKENIZER, EOS = _byte_tokenizer()
# A JSON number, and the digits of its mantissa and exponent.
NUMBER = re.compile(r"-?(?P<int>\d+)(?:\.(?P<frac>\d+))?(?:[eE][+-]?(?P<exp>\d+))?")
STRING = re.compile(r'"(\\.|[^"\\])*"')


def _matcher(schema: dict) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(LLTOKENIZER, StructuredOutput(json=schema).grammar_text)


def accepts(schema: dict, text: str) -> bool:
    matcher = _matcher(schema)
    ids = TOKENIZER.encode(text).ids
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def walk(schema: dict, rng: random.Random, max_bytes: int = 300) -> str | None:
    """A random text the grammar accepts (None: not ended within ``max_bytes``). Half the
    steps pick among the structural bytes allowed, so strings and numbers end."""
    matcher, out = _matcher(schema), []
    for _ in range(max_bytes):
        allowed = [i for i, b in enumerate(matcher.compute_logit_bias()) if b]
        structural = [i for i in allowed if i == EOS or TOKENIZER.decode([i]) in '{}[],:"-.eE+0123456789 tfn']
        token = rng.choice(structural if structural and rng.random() < 0.5 else allowed)
        if token == EOS:
            return TOKENIZER.decode(out)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return None


def check_bounded(text: str, limits: NumberLimits = NumberLimits()) -> None:
    """Every number of a JSON text within ``limits``; whitespace only in the separators."""
    outside = STRING.sub('""', text)
    for number in NUMBER.finditer(outside):
        digits = number["int"].lstrip("0") + (number["frac"] or "")
        assert len(digits) <= limits.digits and len(number["exp"] or "") <= limits.exponent_digits, text
    assert not re.search(r"\s", outside.replace(", ", ",").replace(": ", ":")), text


@pytest.mark.parametrize("schema", SCHEMAS + WALKED_ONLY, ids=range(len(SCHEMAS + WALKED_ONLY)))
def test_every_walk_validates_and_is_bounded(schema):
    unbounded = schema is WALKED_ONLY[-1]
    rng, ended = random.Random(0), 0
    for _ in range(40):
        text = walk(schema, rng)
        if text is None:
            continue
        ended += 1
        jsonschema.validate(json.loads(text), schema)
        if not unbounded:
            check_bounded(text)
    assert ended >= 10


def _in_schema_order(value, schema, root):
    """``value`` with each object's keys in its schema's property order (extra keys last)."""
    if isinstance(schema, dict) and "$ref" in schema:
        schema = root["$defs"][schema["$ref"].split("/")[-1]]
    if isinstance(schema, dict) and "anyOf" in schema:
        schema = next(s for s in schema["anyOf"] if jsonschema.Draft202012Validator(
            {**s, "$defs": root.get("$defs", {})}).is_valid(value))
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(value, dict):
        props = schema.get("properties", {})
        order = sorted(value, key=lambda k: list(props).index(k) if k in props else len(props))
        extra = schema.get("additionalProperties", {})
        return {k: _in_schema_order(value[k], props.get(k, extra), root) for k in order}
    if isinstance(value, list):
        return [_in_schema_order(v, schema.get("items", {}), root) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)  # "1" is a valid number, and the only integer form the grammar writes
    return value


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_instances_in_bounds_are_accepted(schema, data):
    drawn = data.draw(from_schema(copy.deepcopy(schema)))
    # What 2020-12 calls valid (hypothesis-jsonschema reads an older draft).
    assume(jsonschema.Draft202012Validator(schema).is_valid(drawn))
    value = _in_schema_order(drawn, schema, schema)
    text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False, allow_nan=False)
    try:
        check_bounded(text)
    except AssertionError:
        assume(False)
    # A number under bounds is written without an exponent (json_grammar's module note).
    assume(not ("minimum" in json.dumps(schema) and re.search(r"[0-9][eE]", STRING.sub('""', text))))
    # An extra key of an open object is written without escapes (json_grammar's module note).
    named = set(_named(schema))
    assume(not any("\\" in json.dumps(key) for key in _keys(value) if key not in named))
    assert accepts(schema, text), text


def _named(schema) -> list[str]:
    """Every property name a schema names, at any depth."""
    if isinstance(schema, list):
        return [k for v in schema for k in _named(v)]
    if not isinstance(schema, dict):
        return []
    props = schema.get("properties", {})
    return [*(props if isinstance(props, dict) else []), *(k for v in schema.values() for k in _named(v))]


def _keys(value) -> list[str]:
    if isinstance(value, dict):
        return [*value, *(k for v in value.values() for k in _keys(v))]
    return [k for v in value for k in _keys(v)] if isinstance(value, list) else []


def test_strings_take_what_json_allows():
    text = '{"\x7f": "\x7f é \\u00e9 \\n \\"", "k": {"\x7f": ["\\/"]}}'
    assert json.loads(text) and accepts({"type": "object"}, text)
    # Named properties first, extra keys after them.
    assert accepts({"type": "object", "properties": {"k": {}}}, '{"k": {"\x7f": ["\\/"]}, "\x7f": "\x7f"}')
    assert not accepts({"type": "object"}, '{"a": "\n"}')  # a raw control character


def test_length_bounded_strings_take_what_free_strings_take():
    """minLength and maxLength count characters, an escape or a surrogate pair as one, as the
    JSON Schema spec does (jsonschema, on the decoded string): DEL and escapes are characters
    like any other, as in free strings."""
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    in_bounds = ['"a\x7f\\n"', '"a\\u007f\\n"', '"\\ud83d\\ude00\x7f"', '"\U0001F600\\""', '"é\\/"']
    out_of_bounds = ['"a\x7f\\n!"', '"a"', '"\\ud83d\\ude00"', '"\\ud83d\\ude00\\u00e9\\t\x7f"']
    for text in in_bounds + out_of_bounds:
        assert accepts({"type": "string"}, text)
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert valid == (text in in_bounds)
        assert accepts(schema, text) == valid, text
        assert accepts({"type": "object", "properties": {"s": schema}}, f'{{"s": {text}}}') == valid, text


def test_prefix_items():
    assert accepts(PAIR, "[1.5, 2]") and not any(accepts(PAIR, t) for t in ("[1.5]", "[1.5, -2]", "[1.5, 2, 3]"))
    assert all(accepts(TUPLE, t) for t in ('["a"]', '["a", 1]', '["a", 1, null, {"k": [2]}]'))
    assert not any(accepts(TUPLE, t) for t in ("[]", '["a", "b"]', '["a", 1, 2, 3, 4]', "[1]"))


def test_arrays_of_at_most_one_item():
    """A forced single tool call is such an array: the repetition after the first item is gone."""
    one = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 1}
    assert accepts(one, "[7]") and not any(accepts(one, t) for t in ("[]", "[7, 8]"))
    tail = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}, "maxItems": 1}
    assert accepts(tail, '["a"]') and accepts(tail, "[]") and not accepts(tail, '["a", 1]')


def test_a_root_reference_keeps_its_meaning():
    chain = WALKED_ONLY[-1]
    assert accepts(chain, '{"v": 1, "next": {"v": 2, "next": null}}') and not accepts(chain, '{"v": 1, "next": 2}')


@pytest.mark.parametrize("text", ["0", "-0", "7", "-3.1", "0.5", "12345678901234567", "0.12345678901234567",
                                  "1234567890123456.7", "-5.1e-5", "2E+308", "1e999", "4.5e007"])
def test_numbers_within_the_bound_are_accepted(text):
    assert accepts({"type": "number"}, text)


@pytest.mark.parametrize("text", ["-5.100000000000000000", "123456789012345678", "22.1e0000",
                                  "12345678901234567.1", "1234.1234567890123456", "01", "-", "1.", ".5", "1e", "+1", "1 "])
def test_numbers_past_the_bound_or_not_json_are_refused(text):
    assert not accepts({"type": "number"}, text)


def test_the_bound_is_configurable():
    point = StructuredOutput(json=POINT, number_digits=3, exponent_digits=1)
    def ok(text):
        m, ids = llguidance.LLMatcher(LLTOKENIZER, point.grammar_text), TOKENIZER.encode(text).ids
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
    assert ok('{"x": 1.25, "y": -3e9}') and ok('{"x": 0.125, "y": 100}')
    assert not ok('{"x": 1.255, "y": 0}') and not ok('{"x": 1, "y": 1e10}')


@pytest.mark.parametrize("text", ['{ "a": 1}', '{"a":1}', '{"a": [1,  2]}', '{"a": [1, 2] }', '{"a": 1}\n',
                                  '{"a": {"b" : null}}'])
def test_json_objects_have_no_free_whitespace(text):
    assert json.loads(text) and not accepts({"type": "object"}, text)
    assert accepts({"type": "object"}, json.dumps(json.loads(text), separators=(", ", ": ")))


@given(st.integers(-10**20, 10**20), st.integers(-10**20, 10**20), st.integers(-10**21, 10**21))
@settings(max_examples=100, deadline=None)
def test_integer_range_regex_matches_exactly_the_range(a, b, n):
    low, high = min(a, b), max(a, b)
    assert (re.fullmatch(integer_range_regex(low, high), str(n)) is not None) == (low <= n <= high)


def test_integer_bounds_past_the_digit_bound_are_kept():
    for kind in ("integer", "number"):
        big = {"type": kind, "minimum": 10**18}
        assert accepts(big, str(10**18)) and accepts(big, str(10**19 - 1)) and not accepts(big, str(10**18 - 1))


BOUND = st.one_of(st.none(), st.tuples(st.integers(-1000, 1000), st.booleans()))


@given(BOUND, BOUND, st.from_regex(r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,3})?", fullmatch=True))
@settings(max_examples=150, deadline=None)
def test_decimal_range_regex_matches_exactly_the_range(low, high, text):
    widest = (10**4 - 1, True)
    regex = decimal_range_regex(low, high, widest)
    x = Fraction(text)
    low, high = low or (-widest[0], True), high or widest
    inside = (x > low[0] or low[1] and x == low[0]) and (x < high[0] or high[1] and x == high[0])
    negative_zero = text.startswith("-") and x == 0  # never written
    assert (regex is not None and re.fullmatch(regex, text) is not None) == (inside and not negative_zero)


def test_strict_schemas_are_closed_and_loose_ones_open():
    loose = {"type": "object", "properties": {"x": {"type": "integer"}, "p": POINT | {"additionalProperties": True},
                                              "q": {"type": "array", "items": {"properties": {"z": {}}}}},
             "required": ["x"]}
    strict = close_objects(loose)
    assert accepts(loose, '{"x": 1, "k": 2}') and not accepts(strict, '{"x": 1, "k": 2}')
    assert accepts(strict, '{"x": 1}') and accepts(strict, '{"x": 1, "p": {"x": 1, "y": 2, "k": 3}}')
    assert accepts(loose, '{"x": 1, "q": [{"z": 1, "k": 2}]}') and not accepts(strict, '{"x": 1, "q": [{"z": 1, "k": 2}]}')
    assert strict["properties"]["q"]["items"]["additionalProperties"] is False


def test_closing_leaves_data_and_all_of_alone():
    data = {"type": "object", "properties": {}}
    schema = {"anyOf": [{"const": data}, {"enum": [data]}, {"allOf": [{"type": "object", "properties": {"a": {}}},
                                                                      {"type": "object", "properties": {"b": {}}}]}],
              "default": data, "$defs": {"D": {"type": "object"}}}
    closed = close_objects(schema)
    assert closed["anyOf"][:2] == schema["anyOf"][:2] and closed["default"] == data
    assert closed["anyOf"][2] == schema["anyOf"][2]
    assert closed["$defs"]["D"] == {"type": "object", "additionalProperties": False}
    assert data == {"type": "object", "properties": {}}  # the input is not changed
