"""JSON outputs that end: the openai SDK's ``parse()`` of numeric and nested pydantic models
on stories260K returns a parsed object with finish_reason "stop" within 64 tokens, greedy and
sampled. Before numbers were bounded (json_grammar.py), this model wrote digits without end
(``{"x": -3.1, "y": -5.1000000…``) and parse() raised LengthFinishReasonError. The content is
checked against pydantic's own JSON schema with jsonschema, and its numbers against the
bound; a strict schema (response_format or function tool) that does not close its objects
gets no keys it does not name."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from live import serve_in_thread
from paths import STORIES, needs_stories
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.protocol import ChatCompletionRequest
from travelator.server.settings import ServerSettings
from travelator.server.tools import plan_tools

pytestmark = needs_stories


class Point(BaseModel):
    x: float
    y: float


class Counts(BaseModel):
    apples: int
    pears: int


class Route(BaseModel):
    points: list[Point] = Field(max_length=2)


class Reading(BaseModel):
    value: float
    error: float | None


class Pin(BaseModel):
    at: Point


MODELS = [Point, Counts, Route, Reading, Pin]
# A JSON number, and the digits of its mantissa and exponent.
NUMBER = re.compile(r"-?(?P<int>\d+)(?:\.(?P<frac>\d+))?(?:[eE][+-]?(?P<exp>\d+))?")


@pytest.fixture(scope="module")
def client():
    llm = LLM(str(STORIES), dtype="float32")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=["stories"]))
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def _numbers_outside_strings(text: str) -> list[re.Match]:
    """The numbers of a JSON text (its strings blanked out first)."""
    blanked = re.sub(r'"(\\.|[^"\\])*"', lambda m: '"' + " " * (len(m.group()) - 2) + '"', text)
    return list(NUMBER.finditer(blanked))


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_parse_ends_with_a_parsed_object(client, model):
    msgs = [{"role": "user", "content": f"Give me a {model.__name__.lower()} as JSON."}]
    samplings = [dict(temperature=0.0)] + [dict(temperature=1.0, seed=seed) for seed in range(3)]
    for sampling in samplings:
        r = client.chat.completions.parse(model="stories", messages=msgs, response_format=model,
                                          max_tokens=64, **sampling)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (sampling, choice.message.content)
        assert isinstance(choice.message.parsed, model)
        content = choice.message.content
        jsonschema.validate(json.loads(content), model.model_json_schema())
        for number in _numbers_outside_strings(content):
            digits = number["int"].lstrip("0") + (number["frac"] or "")
            assert len(digits) <= 17 and len(number["exp"] or "") <= 3, number.group()


def test_a_strict_schema_is_closed(client):
    # No additionalProperties: strict closes the object, as OpenAI's strict mode does.
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    msgs = [{"role": "user", "content": "Once upon a time"}]
    for seed in range(3):
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
        r = client.chat.completions.create(model="stories", messages=msgs, response_format=fmt,
                                           max_tokens=64, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert list(json.loads(r.choices[0].message.content)) == ["x"]
        # A strict function tool, forced: its arguments likewise.
        tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
        r = client.chat.completions.create(model="stories", messages=msgs, tools=[tool], max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "f"}},
                                           temperature=1.0, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop" and list(json.loads(call.function.arguments)) == ["x"]


def test_strict_function_tools_alone_are_closed():
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": schema, "strict": strict}}
             for name, strict in (("closed", True), ("open", False))]
    for name, closed in (("closed", True), ("open", False)):
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice={"type": "function", "function": {"name": name}})
        forced = plan_tools(req, "hermes").forced_schema()
        assert (forced.get("additionalProperties") is False) == closed
        assert (forced["properties"]["p"].get("additionalProperties") is False) == closed
