"""What a Responses request asks of the chat machinery: its conversation as chat messages (so
it renders through the chat template exactly as chat completions do), its tool plan
(tools.py's), and its one output constraint (``text.format``, a forced call, or
``structured_outputs``)."""

from __future__ import annotations

from travelator.server.constraints import ConstraintSpec, single_constraint, structured_outputs_spec
from travelator.strict_schema import close_objects
from travelator.server.errors import APIError
from travelator.server.protocol import (
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from travelator.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    ResponsesRequest,
    TextFormat,
)
from travelator.server.tools import ToolCallFormat, ToolPlan, plan_tool_use


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """The request's own input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [InputMessage(role="user", content=req.input)]
    return list(req.input)


def chat_messages(instructions: str | None, items: list[InputItem], first_new: int) -> list[ChatMessage]:
    """``items`` as chat messages: a message as itself, consecutive ``function_call`` items as
    one assistant turn's ``tool_calls`` (joined to the assistant message just before them),
    a ``function_call_output`` as a ``tool`` message. ``instructions`` go first, as a system
    message. A 400 names ``input.N`` (N counted from ``first_new``, the request's first own
    item) for an output with no call before it."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                where = f"input.{i - first_new}.call_id" if i >= first_new else "previous_response_id"
                raise APIError(400, f"no function_call with call_id {item.call_id!r} comes before this "
                                    "function_call_output", param=where)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
    return messages


def tool_plan(req: ResponsesRequest, fmt: ToolCallFormat) -> ToolPlan | None:
    """The request's tools and tool choice as chat's tool plan."""
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in req.tools or []]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return plan_tool_use(tools, choice, req.parallel_tool_calls, fmt)


def text_format_spec(fmt: TextFormat | None) -> ConstraintSpec | None:
    """``text.format``: none for text, JSON mode, or the output matching ``schema`` (strict or
    not: the output always matches it here; a strict one is closed, strict_schema.py)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ConstraintSpec({"json_object": True}, "text.format")
    if fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a 'schema' object", param="text.format.schema")
    schema = close_objects(fmt.schema_) if fmt.strict is True else fmt.schema_
    return ConstraintSpec({"json": schema}, "text.format")


def constraint(req: ResponsesRequest, plan: ToolPlan | None) -> ConstraintSpec | None:
    """The request's one output constraint, or a 400 when it sets more than one. ``text.format``
    shapes a text answer, so a forced call (whose arguments are the whole output) sets it aside,
    as OpenAI takes both (the Agents SDK sends an agent's output type with its tools); with
    ``tool_choice`` auto it constrains the output, which then holds no call."""
    forced = plan.forced_schema() if plan is not None else None
    shape = (ConstraintSpec({"json": forced}, "tools") if forced is not None
             else text_format_spec(req.text.format if req.text is not None else None))
    return single_constraint(shape, structured_outputs_spec(req.structured_outputs))
