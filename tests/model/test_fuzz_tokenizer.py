"""Fuzzing the tokenizers and the incremental detokenizer with arbitrary unicode (hypothesis).

For any text: encoding never crashes and gives ids in the vocabulary; decoding those ids (or any
ids) never crashes; streaming them through the incremental detokenizer, in any chunking, gives
exactly the full decode; stop strings never leak into a text that excludes them; and the chat
template renders any message content. The byte-level tokenizer (dummy models) also round-trips
every text exactly (except the spellings of its special tokens, read as those tokens).
"""

from __future__ import annotations

import gguf
import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paths import STORIES
from travelator.engine.detokenizer import IncrementalDetokenizer
from travelator.model.tokenizer import Tokenizer

# The fixture only picks one of two immutable tokenizers: nothing to reset between examples.
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

_TOKENIZERS = {"byte_level": Tokenizer.byte_level(300)}
if STORIES.exists():
    _TOKENIZERS["gguf"] = Tokenizer.from_gguf(gguf.GGUFReader(str(STORIES)))


@pytest.fixture(params=sorted(_TOKENIZERS))
def tok(request) -> Tokenizer:
    return _TOKENIZERS[request.param]


# Any unicode (surrogates cannot be UTF-8 and never reach the server: its JSON parser refuses
# them), with extra weight on what tokenizers find hard: spaces, the SentencePiece underline,
# byte-fallback look-alikes, special-token spellings, combining marks, emoji and CJK.
_tricky = st.sampled_from([" ", "  ", "\n", "\t", "\u2581", "<0x0A>", "<s>", "</s>", "<unk>", "<|user|>",
                           "\u0301", "\ufffd", "\u200d", "😀", "👩‍👩‍👧", "中文", "é", "\x00", "\U0010ffff"])
_text = st.lists(st.one_of(st.text(max_size=12), _tricky), max_size=10).map("".join)
_chunks = st.lists(st.integers(1, 5), min_size=1, max_size=6)


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> tuple[str, str | None]:
    streamed, stop, pos, k = "", None, 0, 0
    while pos < len(ids) and stop is None:
        n = sizes[k % len(sizes)]
        stop = detok.add_tokens(ids[pos:pos + n])
        pos, k = pos + n, k + 1
        streamed += detok.take_delta()
        assert streamed == detok.output_text
    streamed += detok.flush()
    assert streamed == detok.output_text
    return streamed, stop


@FUZZ
@given(text=_text, special=st.booleans())
def test_encode_decode_never_crash(tok: Tokenizer, text: str, special: bool) -> None:
    ids = tok.encode(text, add_special_tokens=special)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    decoded = tok.decode(ids)
    assert isinstance(decoded, str)
    assert isinstance(tok.decode(ids, skip_special_tokens=False), str)
    specials = [tok.id_to_token(i) for i in tok.special_token_ids]
    if tok is _TOKENIZERS["byte_level"] and not any(sp and sp in text for sp in specials):
        # (A special token's spelling in the text is read as that token, as in transformers.)
        assert decoded == text


@FUZZ
@given(text=_text, sizes=_chunks, skip=st.booleans())
def test_incremental_detokenization_equals_full_decode(tok: Tokenizer, text: str, sizes: list[int],
                                                       skip: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    streamed, stop = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, sizes)
    assert stop is None
    assert streamed == tok.decode(ids, skip_special_tokens=skip)


@FUZZ
@given(ids=st.lists(st.integers(0, 600), max_size=40), sizes=_chunks)
def test_any_ids_detokenize_like_the_full_decode(tok: Tokenizer, ids: list[int], sizes: list[int]) -> None:
    ids = [i % tok.vocab_size for i in ids]
    streamed, _ = _stream(IncrementalDetokenizer(tok), ids, sizes)
    assert streamed == tok.decode(ids)


@FUZZ
@given(prompt=_text, text=_text, sizes=_chunks, data=st.data(), include=st.booleans())
def test_stop_strings_with_a_prompt_context(tok: Tokenizer, prompt: str, text: str, sizes: list[int],
                                            data: st.DataObject, include: bool) -> None:
    prompt_ids = tok.encode(prompt or "x")
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    # Stops: pieces of the text itself (so they often hit) and arbitrary strings.
    stops = data.draw(st.lists(st.one_of(_text, st.builds(lambda i, n: full[i:i + n], st.integers(0, 40),
                                                              st.integers(1, 4))), max_size=3))
    detok = IncrementalDetokenizer(tok, stops, include, prompt_token_ids=prompt_ids)
    streamed, stop = _stream(detok, ids, sizes)
    live = [s for s in stops if s]
    if stop is None:
        return
    assert stop in live
    if include:
        assert streamed.endswith(stop)
    else:
        assert not any(s in streamed for s in live), (streamed, live)


@FUZZ
@given(contents=st.lists(_text, min_size=1, max_size=3), role=st.one_of(st.sampled_from(["user", "system"]),
                                                                         st.text(max_size=8)))
def test_chat_template_renders_any_content(tok: Tokenizer, contents: list[str], role: str) -> None:
    messages = [{"role": role, "content": c} for c in contents]
    try:
        ids = tok.encode_chat(messages)
    except jinja2.TemplateError:  # a template may refuse a role; the server answers 400 then
        return
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert isinstance(tok.decode(ids), str)
