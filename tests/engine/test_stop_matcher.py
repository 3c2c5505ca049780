"""StopMatcher: the same answers as searching every stop string, at a cost per character that
does not grow with their number."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from travelator.engine.stop_matcher import StopMatch, StopMatcher

_stops = st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=20, unique=True)
_pieces = st.lists(st.text("abcd", max_size=8), max_size=12)


def _earliest(text: str, stops: list[str], begin: int) -> StopMatch | None:
    """Reference: the stop string starting first (then the longest) among those ending at or
    after `begin`."""
    hits = [(i, -len(s), s) for s in stops for i in range(len(text))
            if text.startswith(s, i) and i + len(s) > begin]
    if not hits:
        return None
    start, _, stop = min(hits)
    return StopMatch(start, stop)


def _held(text: str, stops: list[str]) -> int:
    """Reference: the longest suffix of `text` that begins some stop string."""
    return max((k for k in range(1, len(text) + 1) for s in stops if s.startswith(text[-k:])),
               default=0)


@settings(max_examples=400, deadline=None, database=None)
@given(_stops, _pieces)
def test_pieces_match_a_search_of_every_string(stops: list[str], pieces: list[str]) -> None:
    matcher = StopMatcher(stops)
    state, text = 0, ""
    for piece in pieces:
        state, hit = matcher.feed(state, piece, len(text))
        text += piece
        assert hit == _earliest(text, stops, len(text) - len(piece))
        assert matcher.held(state) == _held(text, stops)


@settings(max_examples=200, deadline=None, database=None)
@given(_stops, st.text("abcd", max_size=10), st.text("abcd", max_size=4))
def test_a_piece_read_from_a_kept_state_leaves_it_unchanged(stops, before, provisional) -> None:
    matcher = StopMatcher(stops)
    state, _ = matcher.feed(0, before, 0)
    _, hit = matcher.feed(state, provisional, len(before))
    assert hit == _earliest(before + provisional, stops, len(before))
    again, _ = matcher.feed(0, before, 0)
    assert again == state


def test_unicode_and_overlapping_strings() -> None:
    matcher = StopMatcher(["😀\n", "\n\n", "é😀", "x"])
    assert matcher.feed(0, "abcé😀\n\n", 0)[1] == StopMatch(3, "é😀")
    state, hit = matcher.feed(0, "é", 0)
    assert hit is None and matcher.held(state) == 1
    assert matcher.feed(state, "😀", 1)[1] == StopMatch(0, "é😀")


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["a", ""])


class _CountingDict(dict):
    """The automaton's edges, counting lookups: its work, independent of the clock."""

    def __init__(self, edges: dict) -> None:
        super().__init__(edges)
        self.lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def _lookups_per_char(stops: list[str], text: str, piece: int) -> float:
    matcher = StopMatcher(stops)
    counter = _CountingDict(matcher._goto)
    matcher._goto = counter
    state = 0
    for pos in range(0, len(text), piece):
        state, hit = matcher.feed(state, text[pos : pos + piece], pos)
        assert hit is None
    return counter.lookups / len(text)


def test_work_per_character_does_not_grow_with_the_number_of_strings() -> None:
    rng = random.Random(0)
    # Ten thousand strings that keep long partial matches alive in a text that never completes
    # one (no "z" in it): a search per string re-reads each of them at every token.
    stops = ["".join(rng.choices("ab", k=rng.randint(1, 40))) + f"z{i}" for i in range(10_000)]
    text = "".join(rng.choice("ab") for _ in range(5_000))
    one = _lookups_per_char(stops[:1], text, 4)
    many = _lookups_per_char(stops, text, 4)
    # A lookup per character, plus at most one per failure link followed (each shortens the
    # match in progress, which grows by at most one per character).
    assert one <= 2 and many <= 2
