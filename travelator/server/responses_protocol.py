"""Request and response bodies of ``/v1/responses`` (OpenAI's Responses API), as pydantic
models. The openai SDK's ``openai.types.responses`` are the reference for every shape.

Input items are messages (``type`` may be left out, as the SDK does), ``function_call`` (a call
the model made earlier) and ``function_call_output`` (its result); any other item type is a 400
naming the item. Items sent back as the SDK received them carry extra keys (``id``,
``status``, ``annotations``...): they are accepted and ignored. Tools are function tools only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag

from travelator.server.protocol import SamplingFields, now

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ---------------------------------------------------------------------------- input


class InputText(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made: an output item, and an input item when sent back."""
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(item: Any) -> str:
    found = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return found if isinstance(found, str) else "message"


# The union's tags, which pydantic puts in an error's location; errors.py leaves them out.
ITEM_TAGS = frozenset({"message", "function_call", "function_call_output"})

InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type)]


# A string or a list of items, told apart by their JSON type so that a bad item is an error
# of that item alone (input.N), not of every member of the union.
ResponseInput = Annotated[
    Annotated[StrictStr, Tag("str")] | Annotated[list[InputItem], Field(min_length=1), Tag("list")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


# ---------------------------------------------------------------------------- tools and text


class FunctionTool(BaseModel):
    """A function tool, flat as the Responses API has it (chat nests it under ``function``)."""
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, JSON mode, or a JSON schema (``name``, ``schema`` and
    ``strict`` at this level, unlike chat's ``response_format``)."""
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``. ``instructions`` go first as a system message and are not
    carried to a follow-up; ``previous_response_id`` prepends a stored response's input and
    output; ``store`` (default true) keeps this one for follow-ups and ``GET``."""

    input: ResponseInput
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    tools: list[FunctionTool] | None = None
    # Default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None


# ---------------------------------------------------------------------------- output


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: ItemStatus
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    previous_response_id: str | None = None
    store: bool = True


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
