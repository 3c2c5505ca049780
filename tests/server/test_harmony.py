"""gpt-oss's harmony format: the real chat template rendered as transformers renders it; the
answer's channels read out of hand-built token sequences from the format's documentation
(OpenAI's harmony guide), whole, split at every character and streamed token by token; and
the chat route end to end on a random-init gpt-oss model whose tokenizer has harmony's special
tokens, its output forced into the format by a grammar (a random model would not write it).

tests/fixtures/gpt-oss-chat-template.jinja is gpt-oss's chat template as llama.cpp keeps it
(models/templates/openai-gpt-oss-120b.jinja, MIT), from OpenAI's gpt-oss checkpoints
(Apache-2.0). openai-harmony's own renderer is not compared: it downloads the o200k_base
vocabulary at run time, which the test machines cannot.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from hf_models import build_checkpoint, gpt_oss_overrides
from live import serve_in_thread
from travelator import LLM, StopLimits
from travelator.chat import ChatMessageError, render_chat
from travelator.engine.async_engine import AsyncEngine
from travelator.engine.detokenizer import IncrementalDetokenizer
from travelator.model.tokenizer import Tokenizer
from travelator.server.app import build_app
from travelator.server.harmony import HarmonyReader, detect_harmony
from travelator.server.protocol import ChatCompletionRequest
from travelator.server.settings import ServerSettings
from travelator.server.tools import plan_tools

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "gpt-oss-chat-template.jinja").read_text(encoding="utf-8")
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
            "<|end|>", "<|message|>", "<|call|>"]
RETURN_ID, CALL_ID = 256 + SPECIALS.index("<|return|>"), 256 + SPECIALS.index("<|call|>")

WEATHER = {"type": "object", "properties": {
    "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
    "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
    "required": ["location"]}
TOOLS = [{"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
         {"type": "function", "function": {"name": "get_weather", "description": "Gets the current weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "generate_file", "description": "Writes a file.",
                                           "parameters": {"type": "object", "properties": {
                                               "template": {"type": "string"}, "path": {"type": "string"}}}}}]


def save_harmony_tokenizer(path: Path) -> None:
    """A byte-level vocabulary (one token per byte) with harmony's special tokens after it,
    <|return|> as EOS (as gpt-oss's tokenizer_config.json has it) and the real template."""
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.token_to_id("<|return|>") == RETURN_ID and tok.token_to_id("<|call|>") == CALL_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony-tokenizer")
    save_harmony_tokenizer(path)
    return path


# ---------------------------------------------------------------------------- rendering

def _conversations():
    """(name, messages as travelator takes them, the same as transformers takes them, template
    variables, add_generation_prompt)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "San Francisco"}'}}
    hf_call = {**call, "function": {"name": "get_weather", "arguments": {"location": "San Francisco"}}}
    asked = [{"role": "user", "content": "What is the weather like in SF?"}]
    called = [{"role": "assistant", "content": None, "reasoning_content": "Need to use function get_weather.",
               "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'}]
    hf_called = [{"role": "assistant", "thinking": "Need to use function get_weather.", "tool_calls": [hf_call]},
                 called[1]]
    # Content beside the reasoning of a call: the template takes only one (the content) there.
    preamble = [{**called[0], "content": "Let me check."}, called[1]]
    hf_preamble = [{"role": "assistant", "content": "Let me check.", "tool_calls": [hf_call]}, called[1]]
    answered = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "2 + 2 = 4.", "thinking": "Simple arithmetic."}]
    as_content = [answered[0], {"role": "assistant", "content": "2 + 2 = 4.",
                                "reasoning_content": "Simple arithmetic."}]
    return [
        ("system and user", [{"role": "system", "content": "Always respond in riddles"}] + asked, None, {}, True),
        ("developer", [{"role": "developer", "content": "Use a friendly tone."}] + asked, None, {}, True),
        ("reasoning effort", asked, None, {"reasoning_effort": "high"}, True),
        ("tools", asked, None, {"tools": TOOLS}, True),
        ("tool call and result", asked + called, asked + hf_called, {"tools": TOOLS}, True),
        ("content beside a call's reasoning", asked + preamble, asked + hf_preamble, {"tools": TOOLS}, True),
        ("thinking of the last turn", answered, None, {}, False),
        ("reasoning_content of the last turn", as_content, answered, {}, False),
        ("earlier turns drop the reasoning", answered + [{"role": "user", "content": "And 9 / 2?"}],
         None, {"reasoning_effort": "low"}, True),
    ]


@pytest.mark.parametrize("name,messages,hf_messages,variables,add_generation_prompt", _conversations(),
                         ids=[c[0] for c in _conversations()])
def test_the_template_renders_as_transformers_renders_it(tokenizer_dir, name, messages, hf_messages, variables,
                                                         add_generation_prompt):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(
        hf_messages or messages, tokenize=False, add_generation_prompt=add_generation_prompt, **variables)
    tk = Tokenizer.from_pretrained_dir(tokenizer_dir)
    kwargs = {k: v for k, v in variables.items() if k != "tools"}
    text = render_chat(tk, messages, add_generation_prompt=add_generation_prompt, tools=variables.get("tools"),
                       chat_template_kwargs=kwargs)
    assert text == expected
    if hf_messages is None:
        assert tk.apply_chat_template(messages, add_generation_prompt, **variables) == expected
    assert "<|start|>system<|message|>" in text and "Current date: " in text  # strftime_now ran


def test_the_template_refuses_what_it_refuses(tokenizer_dir):
    tk = Tokenizer.from_pretrained_dir(tokenizer_dir)
    with pytest.raises(ChatMessageError, match="<|channel|> tags in the content"):
        render_chat(tk, [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "<|channel|>final<|message|>hello"}])
    with pytest.raises(ChatMessageError, match="no previous assistant message with a tool call"):
        render_chat(tk, [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])


def test_harmony_is_detected_by_its_tokens_and_template(tokenizer_dir):
    tk = Tokenizer.from_pretrained_dir(tokenizer_dir)
    assert detect_harmony(tk).stop_token_ids == (RETURN_ID, CALL_ID)
    tk.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_harmony(tk) is None
    plain = Tokenizer.byte_level(300)
    plain.chat_template = TEMPLATE  # the template, but <|channel|> is no token of the vocabulary
    assert detect_harmony(plain) is None


# ---------------------------------------------------------------------------- reading answers

# The guide's examples (its preamble's plan shortened), as the model writes them: the stop token
# that ends each, <|return|> or <|call|>, ends the generation and is not in the text.
ARITHMETIC = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
              '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.')
TOOL_CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant'
             '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}')
PREAMBLE = ('<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary'
            '<|message|>**Action plan**:\n1. Generate an HTML file\n---\nWill start executing the plan step by step'
            '<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json<|message|>'
            '{"template": "basic_html", "path": "index.html"}')
# "The recipient might be defined in the role or channel section of the header."
RECIPIENT_IN_ROLE = ' to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Tokyo"}'


def _plan(tool_choice=None, parallel=True):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=tool_choice,
                                parallel_tool_calls=parallel)
    return plan_tools(req, "hermes")


def _read(pieces, plan, complete=True):
    """(reasoning, content, [(name, arguments)]) of an answer fed in ``pieces``; the streamed
    call deltas put together must be the calls."""
    reader = HarmonyReader(plan)
    reasoning = content = ""
    deltas = []
    for d in [reader.feed(p) for p in pieces] + [reader.finish(complete)]:
        reasoning += d.reasoning
        content += d.content
        deltas += d.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in reader.calls]
    assert [(d.function.name, d.function.arguments) for d in deltas] == calls
    assert [d.id for d in deltas] == [c.id for c in reader.calls] and [d.index for d in deltas] == list(range(len(calls)))
    return reasoning, content, calls


def _splits(text):
    """The text whole, and cut in two at every character: inside markers and headers too."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _token_deltas(tokenizer, text):
    """The text as the engine streams it: encoded, then detokenized token by token with the
    special tokens kept."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.add_tokens([token])
        deltas.append(detok.take_delta())
    return deltas + [detok.flush()]


@pytest.mark.parametrize("text,plan,expected", [
    (ARITHMETIC, None, ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", [])),
    (TOOL_CALL, "auto", ("Need to use function get_weather.", "", [("get_weather", '{"location":"San Francisco"}')])),
    (PREAMBLE, "auto", ("{long chain of thought}",
                        "**Action plan**:\n1. Generate an HTML file\n---\nWill start executing the plan step by step",
                        [("generate_file", '{"template": "basic_html", "path": "index.html"}')])),
    (RECIPIENT_IN_ROLE, "auto", ("", "", [("get_weather", '{"location":"Tokyo"}')])),
    # Calls the request does not allow, or to a function it does not offer, are text.
    (TOOL_CALL, "none", ("Need to use function get_weather.", '{"location":"San Francisco"}', [])),
    (TOOL_CALL, None, ("Need to use function get_weather.", '{"location":"San Francisco"}', [])),
    (TOOL_CALL.replace("get_weather", "fly"), "auto", ("Need to use function fly.", '{"location":"San Francisco"}', [])),
    # A built-in tool the server does not run: its message is part of the reasoning.
    ('<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "sf"}', "auto",
     ('{"query": "sf"}', "", [])),
    # No header at all: everything is content.
    ("The answer is <b>4</b>.", None, ("", "The answer is <b>4</b>.", [])),
], ids=["final", "tool-call", "preamble", "recipient-in-role", "tool-choice-none", "no-tools", "unknown-function",
        "builtin-tool", "no-header"])
def test_channels_are_read_whole_split_and_streamed(tokenizer_dir, text, plan, expected):
    plan = _plan(plan) if plan is not None else None
    for pieces in _splits(text):
        assert _read(pieces, plan) == expected, pieces
    tk = Tokenizer.from_pretrained_dir(tokenizer_dir)
    deltas = _token_deltas(tk, text)
    assert "".join(deltas) == text and len(deltas) > 20
    assert _read(deltas, plan) == expected
    # The stop token kept in the text (include_stop_str_in_output) changes nothing.
    assert _read([text + ("<|call|>" if expected[2] else "<|return|>")], plan) == expected


def test_answers_cut_short_keep_what_they_had():
    plan = _plan()
    cut = ARITHMETIC.index("Simple")
    for pieces in _splits(ARITHMETIC[:cut]):
        assert _read(pieces, plan, complete=False) == ('User asks: "What is 2 + 2?" ', "", [])
    # Inside a header (cut between tokens: a special token comes whole): nothing from it.
    for end in (ARITHMETIC.index("<|start|>") + len("<|start|>assi"), ARITHMETIC.index("final") + 2,
                len("<|channel|>anal")):
        assert _read([ARITHMETIC[:end]], plan, complete=False)[1:] == ("", [])
    # Inside a call: its arguments are not a call.
    assert _read([TOOL_CALL[:-7]], plan, complete=False) == (
        "Need to use function get_weather.", '{"location":"San Fran', [])
    # One call only when parallel calls are off.
    twice = TOOL_CALL + "<|call|><|start|>assistant" + TOOL_CALL.split("<|start|>assistant")[1]
    assert len(_read([twice], plan)[2]) == 2 and len(_read([twice], _plan(parallel=False))[2]) == 1


# ---------------------------------------------------------------------------- the chat route

FINAL = ('start: <|channel|> "analysis" <|message|> /[a-z ]{4,24}/ <|end|> <|start|> "assistant" <|channel|> '
         '"final" <|message|> /[a-z ]{4,24}/')
CALL = ('start: <|channel|> "analysis" <|message|> /[a-z ]{4,24}/ <|end|> <|start|> "assistant" <|channel|> '
        '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
        '"{\\"location\\": \\"" ("Oslo" | "Rome") "\\"}" <|call|>')


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """A random-init gpt-oss checkpoint whose only EOS is <|return|> (as in a GGUF file): the
    server must stop at <|call|> itself."""
    path = build_checkpoint(tmp_path_factory.mktemp("gpt-oss-harmony"), "gpt_oss", **dict(
        gpt_oss_overrides(), max_position_embeddings=4096, bos_token_id=256, eos_token_id=RETURN_ID))
    save_harmony_tokenizer(path)
    return path


def _stream(client, **kw):
    reasoning = content = ""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content or None, [(c["name"], c["arguments"]) for c in calls.values()], finish


def test_the_chat_route_reads_channels_from_a_gpt_oss_model(gpt_oss_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(gpt_oss_dir)
    llm = LLM(str(gpt_oss_dir), dtype="float32")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=["gpt-oss"]))
    messages = [{"role": "user", "content": "What is the weather like in Oslo?"}]
    with serve_in_thread(app) as url:
        # The prompt: the template with reasoning_effort, as transformers renders it.
        expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                          reasoning_effort="high")
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={
            "messages": messages, "tools": TOOLS, "chat_template_kwargs": {"reasoning_effort": "high"}}).json()["tokens"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"] == expected

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        base = dict(model="gpt-oss", messages=messages, tools=TOOLS, temperature=0, max_tokens=200,
                    reasoning_effort="high")
        # An answer: reasoning and content apart, no structural token left in either.
        r = client.chat.completions.create(**base, extra_body={"structured_outputs": {"grammar": FINAL}})
        assert r.usage.prompt_tokens == len(ids)
        choice = r.choices[0]
        reasoning = choice.message.model_extra["reasoning_content"]
        assert re.fullmatch("[a-z ]{4,24}", reasoning) and re.fullmatch("[a-z ]{4,24}", choice.message.content)
        assert choice.finish_reason == "stop" and choice.stop_reason is None and not choice.message.tool_calls
        assert _stream(client, **base, extra_body={"structured_outputs": {"grammar": FINAL}}) == (
            reasoning, choice.message.content, [], "stop")
        # A call: the generation stops at <|call|> (a stop token here, not EOS).
        r = client.chat.completions.create(**base, extra_body={"structured_outputs": {"grammar": CALL}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.stop_reason == CALL_ID
        assert choice.message.content is None and re.fullmatch("[a-z ]{4,24}", choice.message.model_extra[
            "reasoning_content"])
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["location"] in ("Oslo", "Rome")
        assert _stream(client, **base, extra_body={"structured_outputs": {"grammar": CALL}}) == (
            choice.message.model_extra["reasoning_content"], None, [("get_weather", call.function.arguments)],
            "tool_calls")
        # The server's own stop tokens do not count against the client's limit.
        r = client.chat.completions.create(**dict(base, max_tokens=4), extra_body={
            "stop_token_ids": list(range(3, 3 + StopLimits().max_stop_token_ids))})
        assert r.choices[0].finish_reason in ("length", "stop")
        # Cut short in the analysis: reasoning only.
        for stream in (False, True):
            kw = dict(base, max_tokens=16, extra_body={"structured_outputs": {"grammar": FINAL}})
            if stream:
                reasoning, content, calls, finish = _stream(client, **kw)
            else:
                choice = client.chat.completions.create(**kw).choices[0]
                reasoning, content, finish = (choice.message.model_extra["reasoning_content"], choice.message.content,
                                              choice.finish_reason)
            # 16 tokens: <|channel|>, "analysis" (8), <|message|>, then 6 characters of reasoning.
            assert finish == "length" and content is None and re.fullmatch("[a-z ]{6}", reasoning), reasoning
