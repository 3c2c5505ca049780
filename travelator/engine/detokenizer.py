"""Incremental detokenisation and stop strings (no torch).

Each step decodes only a short window of recent ids and diffs it against the window's decode
without the new ids (the prefix/read-offset technique of HF TGI and vLLM), so the cost per token
does not grow with the output length.

Text is made *stable* (part of `_text`) only when later ids cannot change it:

- the window's decode must not end in U+FFFD (an incomplete UTF-8 sequence of a byte-level BPE);
- the last content id must not be a byte-fallback token (`<0xNN>`): `tokenizers`' ByteFallback
  decoder turns a whole run of byte tokens into text at once, and one invalid byte turns the whole
  run into U+FFFD, so text from an unfinished run is provisional.

Stop strings are searched in the stable text plus the provisional tail, i.e. in exactly
`tokenizer.decode(ids_so_far)`, so a stop is found as soon as it is decoded. When none hits,
`flush()` makes `output_text` equal to `tokenizer.decode(output_ids)`. The search is one
automaton over all the stop strings (stop_matcher.py) that reads each stable character once,
and the provisional tail from where the stable text left it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from travelator.engine.stop_matcher import StopMatch, StopMatcher, shared_matcher

if TYPE_CHECKING:
    from travelator.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# How far back into the prompt the first window may reach to find a stable starting token.
_MAX_PROMPT_CONTEXT = 32


class IncrementalDetokenizer:
    """Turns a stream of output ids into text, finds stop strings and hands out safe deltas.

    Usage per step: `stop = d.add_tokens(ids)`, then `d.take_delta()` for streaming; at the end
    (EOS, max_tokens, abort) call `d.flush()` to release any held-back tail. After a stop string
    hit, the text is final (`output_text` is cut) and further tokens are ignored.

    `prompt_token_ids` (optional) gives the decoder the prompt's last tokens as context, so that
    e.g. a first output token `▁there` streams as `" there"`, not `"there"`. Without it,
    `output_text` is exactly `tokenizer.decode(output_ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        *,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._stops = shared_matcher(self.stop) if self.stop else None
        self._stop_state = 0  # the automaton's state after _text[:_checked]
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_token_ids

        context = self._prompt_context(list(prompt_token_ids))
        self._ids: list[int] = context  # window context + output ids (only the tail is ever decoded)
        self.num_output_tokens = 0
        self._last_content = -1  # index in _ids of the last id that is not a skipped special token
        self._tail_is_byte = False  # that id is a byte-fallback token
        for i, tid in enumerate(context):
            self._note(i, tid)
        # Window: ids[_prefix_offset:_read_offset] decode to _prefix_text, already in the text.
        self._prefix_offset = 0  # the context starts at a stable id
        self._read_offset = len(context)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._tail = ""  # provisional text of ids[_read_offset:]

        self._text = ""  # stable text (cut at the stop string once one hits)
        self._checked = 0  # _text[:_checked] has been read by the stop automaton
        self._final_len = 0  # _text[:_final_len] can no longer be part of a stop string
        self._sent = 0  # _text[:_sent] was handed out by take_delta
        self._finished = False
        self.stop_str: str | None = None  # the stop string that ended the text, if any

    # ------------------------------------------------------------------ public API

    def add_tokens(self, new_token_ids: Sequence[int]) -> str | None:
        """Append ids; return the stop string that matched (the text is then final), else None."""
        if self._finished or not new_token_ids:
            return None
        start = len(self._ids)
        self._ids.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        for i in range(start, len(self._ids)):
            self._note(i, self._ids[i])

        new_text = self._decode(self._prefix_offset, len(self._ids))
        # _prefix_text is a prefix of new_text (the window starts at a stable id).
        delta = new_text[len(self._prefix_text) :]
        if self._tail_is_byte or delta.endswith(_REPLACEMENT):
            self._tail = delta  # provisional: later ids may still change it
        else:
            self._tail = ""
            self._text += delta
            self._prefix_offset = self._window_start(len(self._ids))
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

        if self._stops is not None and self._find_stop(self._stops):
            return self.stop_str
        self._update_final_len()
        return None

    @property
    def output_text(self) -> str:
        """All text so far that is final (no held-back stop-string prefix or provisional tail)."""
        return self._text[: self._final_len]

    @property
    def finished(self) -> bool:
        """True after a stop string hit or `flush()`."""
        return self._finished

    def take_delta(self) -> str:
        """Final text not handed out yet (empty when nothing new is safe to stream)."""
        delta = self._text[self._sent : self._final_len]
        self._sent = self._final_len
        return delta

    def flush(self) -> str:
        """End of generation: release the held-back tail and return the last delta."""
        if not self._finished:
            self._text += self._tail
            self._tail = ""
            self._final_len = len(self._text)
            self._finished = True
        return self.take_delta()

    # ------------------------------------------------------------------ internals

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _note(self, index: int, token_id: int) -> None:
        if token_id not in self._skipped:
            self._last_content = index
            self._tail_is_byte = token_id in self._byte_ids

    def _window_start(self, end: int) -> int:
        """Start the next window at the last content id before `end`: decoders that treat the
        first token specially (strip a leading space) then treat both decodes alike."""
        return self._last_content if 0 <= self._last_content < end else 0

    def _prompt_context(self, prompt: list[int]) -> list[int]:
        """The prompt's last stable (content, non-byte) id, alone: byte ids after it would
        join the output's first byte ids in one run, and a run with an invalid byte decodes
        whole to U+FFFD (a stray prompt byte then ate the output's "{"). None in reach (a
        prompt of byte tokens, say CJK text on a byte-fallback vocabulary): the vocabulary's
        first ordinary id stands in, so that the output still does not start the text (whose
        leading space a SentencePiece decoder drops). No prompt: no context."""
        low = max(0, len(prompt) - _MAX_PROMPT_CONTEXT)
        for i in range(len(prompt) - 1, low - 1, -1):
            tid = prompt[i]
            if self._ordinary(tid):
                return [tid]
        if not prompt:
            return []
        specials = self._tokenizer.special_token_ids
        return [next(t for t in range(self._tokenizer.vocab_size) if self._ordinary(t) and t not in specials)]

    def _ordinary(self, token_id: int) -> bool:
        return token_id not in self._skipped and token_id not in self._byte_ids

    def _find_stop(self, stops: StopMatcher) -> bool:
        """Search the decode of all ids so far for the earliest stop string; cut the text there.

        Stop strings that end before `_checked` were looked for already: only the new stable
        text and the provisional tail are read."""
        self._stop_state, hit = stops.feed(self._stop_state, self._text[self._checked :], self._checked)
        self._checked = len(self._text)
        if self._tail:
            _, in_tail = stops.feed(self._stop_state, self._tail, self._checked)
            hit = _first(hit, in_tail)
        if hit is None:
            return False
        text = self._text + self._tail
        end = hit.start + len(hit.stop) if self.include_stop_str_in_output else hit.start
        self._text = text[:end]
        self._tail = ""
        self._final_len = len(self._text)
        self._finished = True
        self.stop_str = hit.stop
        return True

    def _update_final_len(self) -> None:
        """Hold back the longest suffix of the stable text that could start a stop string."""
        hold = 0 if self._stops is None else self._stops.held(self._stop_state)
        self._final_len = max(self._final_len, len(self._text) - hold)


def _first(a: StopMatch | None, b: StopMatch | None) -> StopMatch | None:
    """The match that starts first; `b` ends after `a`, so on a tie it is the longer."""
    if a is None or (b is not None and b.start <= a.start):
        return b
    return a
