"""``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` and ``GET /version``,
in vLLM's shapes.

Benchmark clients (guidellm, aiperf, vLLM's benchmark) and evaluation harnesses count and
score tokens with the served model's own tokenizer; these let them ask the server instead
of a model hub. A chat body is rendered through the chat template exactly as
``/v1/chat/completions`` renders it, so the count is the prompt the engine would see.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel

from travelator.server.chat import render_messages
from travelator.server.errors import APIError
from travelator.server.protocol import ChatMessage, ChatTool, TokenIds
from travelator.server.serving import OpenAIServing
from travelator.server.tools import template_tools


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS as for a completion prompt
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None  # rendered as chat completions render them
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes BOS itself
    return_token_strs: bool = False


class TokenizeRequest(RootModel[TokenizeChatRequest | TokenizeCompletionRequest]):
    """Either form; a body with ``messages`` is the chat one."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    serving.resolve_model(req.model)
    tk = serving.tokenizer
    if isinstance(req, TokenizeChatRequest):
        tools = template_tools(req.tools) if req.tools else None
        text = render_messages(serving, req.messages, req.add_generation_prompt, tools, req.chat_template_kwargs)
    else:
        text = req.prompt
    ids = tk.encode(text, add_special_tokens=req.add_special_tokens)
    strs = [tk.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.model.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    serving.resolve_model(req.model)
    vocab = serving.model.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens, skip_special_tokens=False))


def server_version() -> str:
    try:
        return version("travelator")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
