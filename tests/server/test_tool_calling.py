"""Tool calling: reading calls out of model text (Hermes tags, Llama 3 JSON, the forced JSON
array, a named function's arguments), whole and streamed piece by piece, against calls
written by hand; the chat template's rendering of tools, tool calls and tool results against
transformers' own; and the official SDK against a random-init Qwen2-shaped model whose
template (written here) offers tools: forced calls always parse and validate, streamed and
not; bad tool choices are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import httpx

from hf_models import build_checkpoint
from live import serve_in_thread
from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.protocol import ChatCompletionRequest
from travelator.server.settings import ServerSettings
from travelator.server.tools import ToolCallReader, detect_tool_call_format, plan_tools

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "label": {"type": "string", "maxLength": 8}},
         "required": ["hour", "label"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMA_OF = {"get_weather": WEATHER, "set_alarm": ALARM}

# A Hermes-style template (as Qwen2.5's): tools in a system turn, calls in <tool_call> tags,
# tool results as <tool_response> turns.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for tc in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response id=\"{{ m.tool_call_id }}\">\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _plan(tool_choice=None, parallel=True, fmt="hermes"):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                tool_choice=tool_choice, parallel_tool_calls=parallel)
    return plan_tools(req, fmt)


def _read(plan, text: str, piece: int | None = None):
    """Content and calls [(name, arguments as an object)] of ``text``, fed whole or in
    pieces of ``piece`` characters; also the streamed deltas put together as a client does."""
    reader = ToolCallReader(plan)
    pieces = [text] if piece is None else [text[i:i + piece] for i in range(0, len(text), piece)]
    content, deltas = "", []
    for p in pieces + [None]:
        c, d = reader.feed(p) if p is not None else reader.finish()
        content += c
        deltas += d
    streamed: dict[int, dict] = {}
    for d in deltas:
        call = streamed.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
        call["arguments"] += d.function.arguments or ""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in reader.calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls
    assert [c["id"] for c in streamed.values()] == [c.id for c in reader.calls]
    return content, calls


@pytest.mark.parametrize("piece", [None, 1, 3, 7])
def test_hermes_calls_are_read_whole_and_streamed(piece):
    plan = _plan()
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "set_alarm", "arguments": {"hour": 7, "label": "<up>"}}'
            '</tool_call>')
    assert _read(plan, text, piece) == ("Let me look.", [("get_weather", {"city": "Rome", "days": 2}),
                                                         ("set_alarm", {"hour": 7, "label": "<up>"})])
    # One call only when parallel calls are off; plain text stays content, tags and all.
    assert _read(_plan(parallel=False), text, piece)[1] == [("get_weather", {"city": "Rome", "days": 2})]
    assert _read(plan, "I use <tags> and <tool_ words.", piece) == ("I use <tags> and <tool_ words.", [])
    broken = "Try <tool_call>{not json}</tool_call> then"
    assert _read(plan, broken, piece) == (broken, [])
    unknown = 'A <tool_call>{"name": "fly", "arguments": {}}</tool_call>'
    assert _read(plan, unknown, piece) == (unknown, [])
    # A call cut off without its closing tag still counts when its JSON is whole.
    assert _read(plan, '<tool_call>{"name": "set_alarm", "arguments": {"hour": 1, "label": ""}}', piece) == (
        "", [("set_alarm", {"hour": 1, "label": ""})])


@pytest.mark.parametrize("piece", [None, 1, 5])
def test_llama3_json_calls_are_read(piece):
    plan = _plan(fmt="llama3_json")
    assert _read(plan, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', piece) == (
        "", [("get_weather", {"city": "Oslo", "days": 1})])
    assert _read(plan, '<|python_tag|>{"name": "set_alarm", "parameters": {"hour": 2, "label": "x"}}; '
                       '{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}', piece) == (
        "", [("set_alarm", {"hour": 2, "label": "x"}), ("get_weather", {"city": "Rome", "days": 3})])
    assert _read(plan, "  It is sunny {today}.", piece) == ("  It is sunny {today}.", [])
    # A semicolon inside a string is not a separator; JSON naming no offered tool is an answer.
    assert _read(plan, '{"name": "set_alarm", "parameters": {"hour": 1, "label": "a;b"}}', piece) == (
        "", [("set_alarm", {"hour": 1, "label": "a;b"})])
    assert _read(plan, '{"name": "Bob", "age": 3}', piece) == ('{"name": "Bob", "age": 3}', [])
    assert _read(plan, '{"name": "get_weather", "parameters": {"ci', piece) == (
        '{"name": "get_weather", "parameters": {"ci', [])


def test_forced_calls_are_read_as_they_close():
    plan = _plan("required")
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 4}}, '
            '{"name": "set_alarm", "parameters": {"hour": 9, "label": "a]}\\"b"}}]')
    assert _read(plan, text, 2) == ("", [("get_weather", {"city": "Paris", "days": 4}),
                                         ("set_alarm", {"hour": 9, "label": 'a]}"b'})])
    # The first call is sent as soon as its object closes, before the second is written.
    reader = ToolCallReader(plan)
    first_end = text.index("}}") + 2
    assert reader.feed(text[:first_end - 1])[1] == []
    assert [d.function.name for d in reader.feed(text[first_end - 1:first_end])[1]] == ["get_weather"]
    # Cut short by max_tokens before any call closed: the text is content.
    assert _read(plan, '[{"name": "get_weather", "param', 4) == ('[{"name": "get_weather", "param', [])
    named = _plan({"type": "function", "function": {"name": "set_alarm"}})
    assert _read(named, '{"hour": 5, "label": "run"}', 3) == ("", [("set_alarm", {"hour": 5, "label": "run"})])


def test_forced_schema_and_bad_choices():
    schema = _plan("required", parallel=False).forced_schema()
    good = [{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "get_weather", "parameters": {"hour": 3, "label": "x"}}],
                [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert _plan("none").forced_schema() is None and _plan("auto").forced_schema() is None
    # Tools whose schemas use $defs (as pydantic writes them) keep working when nested.
    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "required": ["at"],
             "$defs": {"Loc": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required",
                                tools=[{"type": "function", "function": {"name": "go", "parameters": point}},
                                       {"type": "function", "function": {"name": "stay", "parameters": point}}])
    schema = plan_tools(req, "hermes").forced_schema()
    jsonschema.validate([{"name": "go", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": {"x": "one"}}}], schema)
    from travelator.structured import StructuredOutput
    StructuredOutput(json=schema)  # compiles
    assert _plan({"type": "function", "function": {"name": "get_weather"}}).forced_schema() == WEATHER
    assert detect_tool_call_format(TEMPLATE) == "hermes"
    assert detect_tool_call_format("{{ '<|python_tag|>' }}{% if m.role == 'ipython' %}") == "llama3_json"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("qwen-tools"), "qwen2", max_position_embeddings=4096)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _conversation():
    return [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And an alarm at 7?"},
    ]


def test_sdk_tool_calls_on_a_qwen2_shaped_model(qwen_dir):
    from transformers import AutoTokenizer

    llm = LLM(str(qwen_dir), dtype="float32")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=["qwen"]))
    with serve_in_thread(app) as url:
        # The template renders tools, calls and results as transformers renders them
        # (transformers takes a call's arguments as an object).
        hf_messages = json.loads(json.dumps(_conversation()))
        hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome", "days": 1}
        expected = AutoTokenizer.from_pretrained(qwen_dir).apply_chat_template(
            hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        ids = httpx.post(f"{url}/tokenize", json={"messages": _conversation(), "tools": TOOLS},
                            timeout=30).json()["tokens"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"] == expected

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        base = dict(model="qwen", messages=_conversation(), tools=TOOLS, max_tokens=300, temperature=0.9)
        for seed in range(3):
            r = client.chat.completions.create(**base, tool_choice="required", seed=seed)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.tool_calls and choice.message.content is None
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
                assert call.id.startswith("call_") and call.type == "function"
            # Streamed: deltas put together give calls that validate, and the same ones as
            # the whole answer for the same seed.
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(**base, tool_choice="required", seed=seed, stream=True):
                for c in chunk.choices:
                    for d in c.delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                        call["name"] = d.function.name or call["name"]
                        call["arguments"] += d.function.arguments or ""
                    finish = c.finish_reason or finish
            assert finish == "tool_calls"
            assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
                (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        # A named function: its arguments, finish_reason "stop" (as OpenAI's API).
        named = {"type": "function", "function": {"name": "set_alarm"}}
        r = client.chat.completions.create(**base, tool_choice=named, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "set_alarm" and r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), ALARM)
        # "auto": calls in the template's format are read out of the text. The output is
        # forced into that format here, since a random model would not write it.
        hermes = (r'Checking\. <tool_call>\{"name": "get_weather", "arguments": '
                  r'\{"city": "(Paris|Oslo)", "days": [1-7]\}\}</tool_call>')
        for stream in (False, True):
            kw = dict(base, tool_choice="auto", extra_body={"structured_outputs": {"regex": hermes}})
            if not stream:
                r = client.chat.completions.create(**kw)
                msg, finish = r.choices[0].message, r.choices[0].finish_reason
                content, calls = msg.content, [(c.function.name, json.loads(c.function.arguments))
                                               for c in msg.tool_calls]
            else:
                content, parts, finish = "", {}, None
                for chunk in client.chat.completions.create(**kw, stream=True):
                    for c in chunk.choices:
                        content += c.delta.content or ""
                        for d in c.delta.tool_calls or []:
                            part = parts.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                            part["arguments"] += d.function.arguments or ""
                        finish = c.finish_reason or finish
                calls = [(p["name"], json.loads(p["arguments"])) for p in parts.values()]
            assert content == "Checking." and finish == "tool_calls", (content, finish)
            assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1]["city"] in ("Paris", "Oslo")
        # "none": text only.
        r = client.chat.completions.create(**{**base, "max_tokens": 8}, tool_choice="none")
        assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].finish_reason == "length"
        for kw, param in [
            (dict(tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice"),
            (dict(tools=None, tool_choice="required"), "tool_choice"),
            (dict(tools=[TOOLS[0], TOOLS[0]]), "tools"),
            (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                  tool_choice="required"), "tools"),
            (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(**{**base, **kw})
            assert err.value.body["param"] == param, (kw, err.value.body)
