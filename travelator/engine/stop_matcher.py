"""Stop strings as one Aho-Corasick automaton, built once per request (no torch).

The detokenizer feeds it only the text each step adds. Following a failure link shortens the
match in progress, so over a stream there are at most as many of them as characters read: the
cost per character does not depend on how many stop strings there are, where searching every
string in every step cost O(strings x longest) per token, on the step thread every request
waits for.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["StopMatch", "StopMatcher", "shared_matcher"]

_ROOT = 0


def _edge(state: int, char: str) -> int:
    # One int key per trie edge: a code point fits in 21 bits.
    return (state << 21) | ord(char)


class StopMatch(NamedTuple):
    start: int  # where the stop string begins in the text fed so far
    stop: str


class StopMatcher:
    """Reads text in pieces from a state (an int; `_ROOT`, 0, before any text) and reports the
    earliest stop string that ends in each piece.

    A state stands for the longest suffix of the text read that begins some stop string, so
    `held(state)` is how much of the text may still turn into a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._goto: dict[int, int] = {}
        self._depth = [0]
        children: list[list[tuple[str, int]]] = [[]]
        ends: dict[int, str] = {}
        for stop in stops:
            state = _ROOT
            for char in stop:
                nxt = self._goto.get(_edge(state, char))
                if nxt is None:
                    nxt = len(self._depth)
                    self._goto[_edge(state, char)] = nxt
                    self._depth.append(self._depth[state] + 1)
                    children.append([])
                    children[state].append((char, nxt))
                state = nxt
            ends[state] = stop
        # Breadth first, so that a state's failure link (its longest proper suffix in the trie)
        # and that state's own longest stop string are known before the state is.
        self._fail = [_ROOT] * len(self._depth)
        self._out: list[str | None] = [None] * len(self._depth)  # longest stop string ending here
        queue = deque([_ROOT])
        while queue:
            state = queue.popleft()
            for char, child in children[state]:
                if state != _ROOT:
                    self._fail[child] = self._next(self._fail[state], char)
                self._out[child] = ends.get(child, self._out[self._fail[child]])
                queue.append(child)

    def held(self, state: int) -> int:
        """Length of the longest suffix of the text read that begins a stop string: after a
        piece with no match, what may still become one."""
        return self._depth[state]

    def feed(self, state: int, text: str, offset: int) -> tuple[int, StopMatch | None]:
        """Read `text`, which follows `offset` characters that left the automaton in `state`.

        Returns the state after it and, of the stop strings that end in `text`, the one that
        starts first (the longest of those that start there), or None.
        """
        best: StopMatch | None = None
        for i, char in enumerate(text):
            state = self._next(state, char)
            stop = self._out[state]
            if stop is not None:
                start = offset + i + 1 - len(stop)
                # Read left to right: a match that starts where the best one does ends later,
                # so it is the longer one.
                if best is None or start <= best.start:
                    best = StopMatch(start, stop)
        return state, best

    def _next(self, state: int, char: str) -> int:
        goto = self._goto
        while True:
            nxt = goto.get(_edge(state, char))
            if nxt is not None:
                return nxt
            if state == _ROOT:
                return _ROOT
            state = self._fail[state]


@functools.lru_cache(maxsize=16)
def shared_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton for these stop strings, built once while in use: the choices of a request,
    and requests that send the same strings (an evaluation harness's), share it (nothing
    changes it after it is built), so the step thread builds it once."""
    return StopMatcher(stops)
