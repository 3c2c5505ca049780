"""The Responses API with tools and state, against a live server: the OpenAI Agents SDK's
default model (``OpenAIResponsesModel``) running a two-tool agent to its final answer, streamed
and not, checked by what the server received; the streamed events of function calls through
the openai SDK's own parser; ``responses.parse`` on stories260K; ``previous_response_id``
chains counted against transformers' rendering of the same conversation; GET / DELETE / 404;
bad inputs as 400s naming the field. The store's bounds with a clock of the test's own."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
from openai.types.responses import Response
import pytest
from pydantic import BaseModel

from hf_models import build_checkpoint
from live import serve_in_thread
from paths import STORIES, needs_stories
from test_tool_calling import ALARM, TEMPLATE, WEATHER
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.response_store import ResponseStore, stored
from travelator.server.responses_input import text_format_spec
from travelator.server.responses_protocol import ResponseObject, TextFormat
from travelator.server.settings import ServerSettings

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
         {"type": "function", "name": "set_alarm", "parameters": ALARM}]
SCHEMA_OF = {"get_weather": WEATHER, "set_alarm": ALARM}


def _recording(app, log: list[dict]):
    """``app``, noting every body POSTed to /v1/responses as it reaches the server."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/responses" or scope["method"] != "POST":
            return await app(scope, receive, send)
        chunks: list[bytes] = []

        async def recorded_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    log.append(json.loads(b"".join(chunks)))
            return message

        return await app(scope, recorded_receive, send)

    return wrapped


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("qwen-responses"), "qwen2", max_position_embeddings=4096)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    log: list[dict] = []
    llm = LLM(str(qwen_dir), dtype="float32")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=["qwen"]))
    with serve_in_thread(_recording(app, log)) as url:
        yield url, log


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def _run_agent(url: str, streamed: bool):
    """A two-tool agent on the Agents SDK's default (Responses) model, steered: the first
    turn must call get_weather, the tool then demands set_alarm, whose tool demands text."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client
    from agents import set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    called: list[tuple[str, dict]] = []
    agent: Agent

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        called.append(("get_weather", {"city": city}))
        agent.model_settings = ModelSettings(tool_choice="set_alarm", max_tokens=40, temperature=0)
        return f"sunny in {city}"

    @function_tool
    def set_alarm(when: Literal["dawn", "noon"]) -> str:
        """Set an alarm."""
        called.append(("set_alarm", {"when": when}))
        # The last turn answers in text: steered to words that end, as a random model would not.
        agent.model_settings = ModelSettings(tool_choice="none", max_tokens=40, temperature=0, extra_body={
            "structured_outputs": {"regex": "All set: [a-z]{1,8}\\."}})
        return f"alarm at {when}"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(name="helper", instructions="Plan the day.", model="qwen", tools=[get_weather, set_alarm],
                  reset_tool_choice=False,
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0))

    async def go():
        assert isinstance(agent.model, str)  # resolved by the default provider: the Responses model
        if not streamed:
            return await Runner.run(agent, "What should I do today?", max_turns=5)
        result = Runner.run_streamed(agent, "What should I do today?", max_turns=5)
        kinds = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        assert "response.function_call_arguments.delta" in kinds and "response.completed" in kinds
        return result

    from agents.models.multi_provider import MultiProvider
    assert isinstance(MultiProvider().get_model("qwen"), OpenAIResponsesModel)
    return asyncio.run(go()), called


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_default_model_runs_two_tools_to_a_final_answer(qwen, streamed):
    url, log = qwen
    start = len(log)
    result, called = _run_agent(url, streamed)
    bodies = log[start:]
    # model -> get_weather -> model -> set_alarm -> model -> final text, all through /v1/responses.
    assert [name for name, _ in called] == ["get_weather", "set_alarm"]
    assert len(bodies) == 3, bodies
    assert [b.get("tool_choice") for b in bodies] == [{"type": "function", "name": "get_weather"},
                                                      {"type": "function", "name": "set_alarm"}, "none"]
    assert all(b["instructions"] == "Plan the day." and [t["name"] for t in b["tools"]] == [
        "get_weather", "set_alarm"] for b in bodies)
    for turn, (name, args) in enumerate(called, start=1):
        # Each later turn sends back the call the server answered and the tool's output for it.
        items = bodies[turn]["input"]
        calls = [i for i in items if i.get("type") == "function_call"]
        outputs = [i for i in items if i.get("type") == "function_call_output"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == called[:turn]
        assert [o["call_id"] for o in outputs] == [c["call_id"] for c in calls]
        assert outputs[-1]["output"] in (f"sunny in {args.get('city')}", f"alarm at {args.get('when')}")
    assert isinstance(result.final_output, str) and re.fullmatch(r"All set: [a-z]{1,8}\.", result.final_output)
    last = result.raw_responses[-1]
    assert last.output[-1].type == "message" and last.output[-1].content[0].text == result.final_output


def test_streamed_function_call_events_through_the_sdk(qwen):
    url, _ = qwen
    client = _client(url)
    base = dict(model="qwen", input="Weather and an alarm?", tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=300, temperature=0.9)
    for seed in range(2):
        whole = client.responses.create(**base, extra_body={"seed": seed})
        events = list(client.responses.create(**base, extra_body={"seed": seed}, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.completed"
        streamed = events[-1].response
        calls = [o for o in streamed.output if o.type == "function_call"]
        assert calls and [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole.output if c.type == "function_call"]
        for index, call in enumerate(streamed.output):
            assert call.type == "function_call" and call.status == "completed"
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])
            mine = [e for e in events if getattr(e, "output_index", None) == index]
            assert [e.type for e in mine][0] == "response.output_item.added"
            assert mine[0].item.id == call.id and mine[0].item.status == "in_progress"
            deltas = [e.delta for e in mine if e.type == "response.function_call_arguments.delta"]
            assert "".join(deltas) == call.arguments
            (done,) = [e for e in mine if e.type == "response.function_call_arguments.done"]
            assert done.arguments == call.arguments and done.item_id == call.id
            assert mine[-1].type == "response.output_item.done" and mine[-1].item == call
    # Text before a call, read from Hermes tags with tool_choice auto (forced into that shape
    # here): a message item, then a function_call item, streamed and not.
    hermes = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": 2\}\}</tool_call>'
    kw = dict(base, tool_choice="auto", extra_body={"structured_outputs": {"regex": hermes}})
    for resp in (client.responses.create(**kw),
                 [e for e in client.responses.create(**kw, stream=True)][-1].response):
        message, call = resp.output
        assert message.type == "message" and message.content[0].text == "Checking."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments)["days"] == 2 and call.call_id.startswith("call_")


def _hf_ids(tok, messages, tools=None) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_previous_response_id_chains_get_and_delete(qwen, hf_tokenizer):
    url, _ = qwen
    client = _client(url)
    first = client.responses.create(model="qwen", input="Hello there", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert first.usage.input_tokens == len(_hf_ids(hf_tokenizer, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]))
    # The SDK builds answers without validating them: what the server sent must also pass
    # its model's validation (every required field, e.g. usage's cache_write_tokens).
    Response.model_validate(first.to_dict())
    second = client.responses.create(model="qwen", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    # The first exchange comes first; its instructions are not carried over (as OpenAI).
    assert second.usage.input_tokens == len(_hf_ids(hf_tokenizer, [
        {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}]))
    assert second.previous_response_id == first.id
    # A call answered in a follow-up: the stored call is found by its call_id.
    call_resp = client.responses.create(model="qwen", input="Weather?", tools=TOOLS, max_output_tokens=200,
                                        tool_choice={"type": "function", "name": "get_weather"})
    (call,) = call_resp.output
    follow = client.responses.create(model="qwen", previous_response_id=call_resp.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}], max_output_tokens=4,
        tool_choice="none")
    hf_call = {"id": call.call_id, "type": "function",
               "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}
    hf_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    assert follow.usage.input_tokens == len(_hf_ids(hf_tokenizer, [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [hf_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "rain"}],
        tools=hf_tools))
    # Text and a call in one answer are one assistant turn when sent back.
    hermes = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 3\}\}</tool_call>'
    mixed = client.responses.create(model="qwen", input="Weather?", tools=TOOLS, max_output_tokens=200,
                                    extra_body={"structured_outputs": {"regex": hermes}})
    message, call = mixed.output
    follow = client.responses.create(model="qwen", input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "snow"}],
        previous_response_id=mixed.id, tools=TOOLS, tool_choice="none", max_output_tokens=4)
    hf_call = {"id": call.call_id, "type": "function",
               "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}
    assert follow.usage.input_tokens == len(_hf_ids(hf_tokenizer, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [hf_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "snow"}], tools=hf_tools))
    # GET gives what create gave; DELETE removes it; then it is a 404, as a follow-up's base too.
    got = client.responses.retrieve(second.id)
    assert got.model_dump() == second.model_dump()
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="qwen", input="x", previous_response_id=second.id)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)
    unstored = client.responses.create(model="qwen", input="x", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, param", [
    (dict(tools=[{"type": "web_search"}]), "tools.0"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "fly"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input.0"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}]), "input.0.call_id"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(text={"format": {"type": "yaml"}}), "text.format.type"),
    (dict(tools=TOOLS, tool_choice="required", extra_body={"structured_outputs": {"json_object": True}}),
     "structured_outputs"),
    (dict(text={"format": {"type": "json_object"}}, extra_body={"structured_outputs": {"regex": "a"}}),
     "structured_outputs"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(store="yes"), "store"),
])
def test_bad_inputs_are_400s_naming_the_field(qwen, body, param):
    url, _ = qwen
    with pytest.raises(openai.BadRequestError) as err:
        _client(url).responses.create(**{"model": "qwen", "input": "hi", **body})
    assert err.value.body["param"] == param, err.value.body
    if param == "tools.0":
        assert "other tool types are not supported" in err.value.body["message"]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    happy: bool


class Owner(BaseModel):
    pet: Pet
    tidy: bool


class Point(BaseModel):
    x: float
    y: float


@pytest.fixture(scope="module")
def stories_url():
    llm = LLM(str(STORIES), dtype="float32", num_kv_blocks=256)
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=["stories"]))
    with serve_in_thread(app) as url:
        yield url


@needs_stories
@pytest.mark.parametrize("model", [Pet, Owner, Point])
def test_responses_parse_on_stories260k(stories_url, model):
    client = _client(stories_url)
    for seed in range(2):
        resp = client.responses.parse(model="stories", input="Tell me about a pet.", text_format=model,
                                      max_output_tokens=64, temperature=1.0,
                                      extra_body={"seed": seed})
        assert resp.status == "completed" and isinstance(resp.output_parsed, model)
        assert model.model_validate_json(resp.output_text) == resp.output_parsed
        assert resp.text.format.type == "json_schema" and resp.text.format.strict is True


def test_a_strict_text_format_is_closed_and_a_loose_one_open():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    strict = text_format_spec(TextFormat(type="json_schema", schema=schema, strict=True)).fields["json"]
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    loose = text_format_spec(TextFormat(type="json_schema", schema=schema)).fields["json"]
    assert "additionalProperties" not in loose


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _response(i: int, text: str = "") -> ResponseObject:
    return ResponseObject.model_validate({
        "id": f"resp_{i}", "status": "completed", "model": "m", "output": [{
            "type": "message", "id": f"msg_{i}", "status": "completed", "content": [{"text": text}]}]})


def test_store_bounds_count_bytes_and_expiry():
    clock = _Clock()
    store = ResponseStore(max_count=2, max_bytes=1 << 20, ttl_s=10.0, clock=clock)
    for i in range(3):
        store.keep(_response(i), [])
    assert store.get("resp_0") is None and len(store) == 2  # the oldest went
    assert store.get("resp_1") is not None  # now the most recently used
    store.keep(_response(3), [])
    assert store.get("resp_2") is None and store.get("resp_1") is not None
    clock.now = 9.9
    assert store.get("resp_3") is not None
    clock.now = 10.0
    assert store.get("resp_3") is None and store.get("resp_1") is None and len(store) == 0
    assert store.num_bytes == 0
    # The byte bound: room for two and a half answers of one size; a third pushes the first out.
    size = stored(_response(0, "x" * 500), [], 0.0).size
    assert size > len("x" * 500) * 2  # the text is counted in the response and in the conversation
    small = ResponseStore(max_count=100, max_bytes=size * 5 // 2, ttl_s=10.0, clock=clock)
    for i in range(3):
        small.keep(_response(i, "x" * 500), [])
    assert small.get("resp_0") is None and small.get("resp_1") is not None and small.get("resp_2") is not None
    entry = small.get("resp_2")
    assert entry.conversation[-1].content[0].text == "x" * 500  # the output, read back as input
    assert small.num_bytes == 2 * size
    assert small.delete("resp_1") and not small.delete("resp_1") and len(small) == 1
