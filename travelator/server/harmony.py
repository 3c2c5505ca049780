"""gpt-oss's harmony format read out of a chat answer: its channels become the message's
fields, whole or as the answer streams.

A harmony answer is a run of messages, each ``<|start|>{header}<|message|>{body}`` ended by
``<|end|>``, or by ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call): both stop
the generation. The prompt ends with ``<|start|>assistant``, so the first header comes without
``<|start|>``. The header names a channel after ``<|channel|>`` and may name a recipient,
``to=...`` (before or after the channel), and a content type (``<|constrain|>json``)::

    <|channel|>analysis<|message|>Need to use function get_weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"SF"}<|call|>

The bodies go to:

- ``analysis`` (the chain of thought), and messages to a tool the server does not offer (the
  built-in ``browser``, ``python``): ``reasoning_content``;
- ``final`` and ``commentary`` without a recipient (a preamble meant for the user), and any
  text outside a header (an answer that ignores the format): ``content``;
- ``commentary to=functions.NAME``: a tool call when tool_choice is "auto" and NAME is offered
  (arguments: the body, JSON text), sent whole when its message ends; otherwise content.

The text read is decoded with special tokens kept, so the structural tokens arrive as their
strings, split anywhere between deltas. An answer cut short keeps what it had: the reasoning
so far, a call's arguments as content; a header cut short gives nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from travelator.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from travelator.server.tools import ToolPlan, call_id, partial_suffix

if TYPE_CHECKING:
    from travelator.model.tokenizer import Tokenizer

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL)
# Text before any header longer than this is no header's role or recipient: the model is
# writing plain text, streamed as content from there on.
_MAX_BARE_HEADER = 128
_RECIPIENT = re.compile(r"to=([^\s<]+)")

_Kind = Literal["reasoning", "content", "call"]


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    """A model that answers in harmony: its stop tokens, ``<|return|>`` and ``<|call|>``, which
    each request stops at (a GGUF file's vocabulary may name only ``<|return|>`` as EOS)."""
    stop_token_ids: tuple[int, ...]


def detect_harmony(tokenizer: Tokenizer) -> HarmonyFormat | None:
    """The harmony format when the chat template writes channels and the structural tokens are
    special tokens of the vocabulary, else None (``<|constrain|>`` may be plain text: it is
    read as text either way)."""
    if not tokenizer.chat_template or CHANNEL not in tokenizer.chat_template:
        return None
    ids = {}
    for marker in (START, END, MESSAGE, CHANNEL, RETURN, CALL):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1 or encoded[0] not in tokenizer.special_token_ids:
            return None
        ids[marker] = encoded[0]
    return HarmonyFormat((ids[RETURN], ids[CALL]))


@dataclass(slots=True)
class HarmonyDelta:
    """What a piece of the answer adds to each field of the message."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass(slots=True)
class HarmonyReader:
    """Reads one choice's text as it comes: ``feed`` each new piece, ``finish`` at the end;
    the whole answer is the same reader fed once. ``plan``: the request's tools (None: none)."""
    plan: ToolPlan | None
    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""  # text not read yet: it may end with the start of a marker
    _header: str | None = ""  # the header so far (None: in a body)
    _after_start: bool = False  # the header began with <|start|> (a role comes first)
    _kind: _Kind = "content"  # the body's
    _function: str = ""  # a call's
    _arguments: str = ""  # a call's body so far

    def feed(self, text: str) -> HarmonyDelta:
        out = HarmonyDelta()
        self._pending += text
        self._read(out, final=False)
        return out

    def finish(self, complete: bool) -> HarmonyDelta:
        """The rest; ``complete``: the model ended its turn (not cut short by a limit)."""
        out = HarmonyDelta()
        self._read(out, final=True)
        if self._header is None:
            self._close_body(out, complete)
        else:
            self._close_header(out)
        return out

    # -- reading -------------------------------------------------------------------------
    def _read(self, out: HarmonyDelta, final: bool) -> None:
        while self._pending:
            at, marker = _first_marker(self._pending)
            if marker is None:
                keep = 0 if final else max(partial_suffix(self._pending, m) for m in _MARKERS)
                self._text(self._pending[:len(self._pending) - keep], out)
                self._pending = self._pending[len(self._pending) - keep:]
                return
            self._text(self._pending[:at], out)
            self._pending = self._pending[at + len(marker):]
            self._marker(marker, out)

    def _text(self, text: str, out: HarmonyDelta) -> None:
        if self._header is None:
            if self._kind == "reasoning":
                out.reasoning += text
            elif self._kind == "content":
                out.content += text
            else:
                self._arguments += text
            return
        self._header += text
        if not self._after_start and CHANNEL not in self._header and len(self._header) > _MAX_BARE_HEADER:
            out.content += self._header
            self._header, self._kind = None, "content"

    def _marker(self, marker: str, out: HarmonyDelta) -> None:
        if self._header is None:  # any marker ends a body (a well-formed one ends at <|end|>)
            self._close_body(out, complete=True)
            if marker in _ENDS:
                return
        if marker == MESSAGE:
            self._open_body(self._header or "")
        elif marker in (CHANNEL, CONSTRAIN):
            self._header = (self._header or "") + marker
        else:  # <|start|> or an end: the header so far had no body
            self._close_header(out)
            self._after_start = marker == START

    def _close_header(self, out: HarmonyDelta) -> None:
        """A header that got no body: plain text if it was outside the format (no <|start|>,
        no channel), else nothing."""
        if self._header and not self._after_start and CHANNEL not in self._header and CONSTRAIN not in self._header:
            out.content += self._header.strip()
        self._header, self._after_start = "", False

    def _open_body(self, header: str) -> None:
        channel_part = header.partition(CHANNEL)[2]
        words = channel_part.replace(CONSTRAIN, " ").split()
        channel = words[0] if words else None
        found = _RECIPIENT.search(header)
        recipient = found.group(1) if found and found.group(1) != "assistant" else None
        self._header, self._after_start = None, False
        if recipient is not None and recipient.startswith("functions."):
            name = recipient.removeprefix("functions.")
            allowed = self.plan is not None and self.plan.mode == "auto" and self.plan.offers(name)
            self._kind, self._function, self._arguments = ("call" if allowed else "content"), name, ""
        elif recipient is not None or channel == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _close_body(self, out: HarmonyDelta, complete: bool) -> None:
        if self._kind == "call":
            if complete:
                out.tool_calls += self._emit(FunctionCall(name=self._function, arguments=self._arguments.strip()))
            else:  # cut short: the arguments are not a call
                out.content += self._arguments
        self._header, self._after_start, self._kind, self._arguments = "", False, "content", ""

    def _emit(self, call: FunctionCall) -> list[DeltaToolCall]:
        if self.calls and self.plan is not None and not self.plan.parallel:
            return []
        self.calls.append(ToolCall(id=call_id(), function=call))
        return [DeltaToolCall(index=len(self.calls) - 1, id=self.calls[-1].id, type="function",
                              function=DeltaFunctionCall(name=call.name, arguments=call.arguments))]


def _first_marker(text: str) -> tuple[int, str | None]:
    """Where the first whole marker in ``text`` begins, and which; (-1, None) if none."""
    at = text.find("<|")
    while at >= 0:
        for marker in _MARKERS:
            if text.startswith(marker, at):
                return at, marker
        at = text.find("<|", at + 2)
    return -1, None
