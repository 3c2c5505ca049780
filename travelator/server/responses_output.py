"""A response's output items as its text arrives: the ``message`` item (its text) and one
``function_call`` item per call the tool-call reader found, in the order they began, with the
streamed events that announce them (the openai SDK's ``ResponseStreamEvent`` shapes, less
``sequence_number``, which the stream numbers). A non-streamed answer is the same builder fed
once, its events unused."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from travelator.server.protocol import DeltaToolCall
from travelator.server.responses_protocol import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
)

Event = tuple[str, dict[str, Any]]  # (type, fields)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Message:
    index: int  # output_index
    item: OutputMessage
    text: str = ""


@dataclass(slots=True)
class OutputItems:
    """Feed content pieces and tool-call deltas with ``add``; ``close`` ends every item."""
    message_id: str = field(default_factory=lambda: item_id("msg"))
    _message: _Message | None = None
    _calls: dict[int, tuple[int, OutputFunctionCall]] = field(default_factory=dict)  # call index ->
    _count: int = 0

    def open_message(self) -> list[Event]:
        """The message item and its one text part, before any text (a text answer opens it
        first; with tools it opens at the first content)."""
        if self._message is not None:
            return []
        self._message = _Message(self._count, OutputMessage(id=self.message_id, status="in_progress", content=[]))
        self._count += 1
        where = {"output_index": self._message.index, "item_id": self.message_id}
        return [("response.output_item.added", {"output_index": self._message.index, "item": self._message.item}),
                ("response.content_part.added", {**where, "content_index": 0, "part": OutputText(text="")})]

    def add(self, content: str, calls: list[DeltaToolCall], every_step: bool = False) -> list[Event]:
        """``every_step``: a text delta even when ``content`` is empty (one per token step)."""
        events = []
        if content or every_step:
            events += self.open_message()
            self._message.text += content
            events.append(("response.output_text.delta", {
                "output_index": self._message.index, "item_id": self.message_id, "content_index": 0,
                "delta": content, "logprobs": []}))
        for delta in calls:
            events += self._add_call(delta)
        return events

    def _add_call(self, delta: DeltaToolCall) -> list[Event]:
        events = []
        if delta.index not in self._calls:
            call = OutputFunctionCall(id=item_id("fc"), call_id=delta.id, name=delta.function.name,
                                      arguments="", status="in_progress")
            self._calls[delta.index] = (self._count, call)
            events.append(("response.output_item.added", {"output_index": self._count, "item": call.model_copy()}))
            self._count += 1
        index, call = self._calls[delta.index]
        if delta.function.arguments:
            call.arguments += delta.function.arguments
            events.append(("response.function_call_arguments.delta", {
                "output_index": index, "item_id": call.id, "delta": delta.function.arguments}))
        return events

    def close(self, status: ItemStatus) -> tuple[list[OutputItem], list[Event]]:
        """Every item, ended with ``status`` (a call the reader read whole is completed),
        in output order, and the events that end them."""
        ended: list[tuple[int, OutputItem, list[Event]]] = []
        # An answer with nothing in it is still one (empty) message.
        opened = self.open_message() if self._message is None and not self._calls else []
        if self._message is not None:
            m = self._message
            text = OutputText(text=m.text)
            item = OutputMessage(id=self.message_id, status=status, content=[text])
            where = {"output_index": m.index, "item_id": self.message_id, "content_index": 0}
            ended.append((m.index, item, [
                ("response.output_text.done", {**where, "text": m.text, "logprobs": []}),
                ("response.content_part.done", {**where, "part": text}),
                ("response.output_item.done", {"output_index": m.index, "item": item})]))
        for index, call in self._calls.values():
            call.status = "completed"
            ended.append((index, call, [
                ("response.function_call_arguments.done", {
                    "output_index": index, "item_id": call.id, "arguments": call.arguments}),
                ("response.output_item.done", {"output_index": index, "item": call})]))
        ended.sort(key=lambda e: e[0])
        return [item for _, item, _ in ended], opened + [ev for _, _, events in ended for ev in events]
