"""Tokenizer: GGUF llama vocab, HF directory, byte-level dummy vocab, chat templates.

References: the ids documented in shared/models/README.md (checked against llama.cpp there),
transformers' own GGUF-to-tokenizers conversion, and transformers' `AutoTokenizer` /
`apply_chat_template` on the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paths import STORIES, needs_stories
from travelator.model.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer

pytestmark = needs_stories

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)

CHATS = [
    [{"role": "user", "content": "Tell me a story."}],
    [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "  Hi there  "},
        {"role": "assistant", "content": "Once upon a time"},
        {"role": "user", "content": "More, please!\nThanks."},
    ],
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "Once upon a time there was a little girl named Lily She loved to play outside park".split()
    alphabet = "abcdefghijklmnopqrstuvwxyzABC .,!?'\"\n\t  ïé😀中"
    texts = ["Once upon a time", "Hello, world!", "Sam wanted to go to the park.\nThe end.", "a\tb\n\nc  d"]
    for i in range(n):
        if i % 2:
            texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
        else:
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))))
    return texts


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(str(STORIES))


@pytest.fixture(scope="module")
def tok(reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


# ---------------------------------------------------------------------- GGUF


def test_gguf_readme_ids(tok: Tokenizer) -> None:
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
    assert [tok.id_to_token(i) for i in (403, 407, 261, 378)] == ["▁Once", "▁upon", "▁a", "▁time"]
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})
    assert tok.vocab_size == 512
    assert tok.add_bos_token is True
    assert tok.chat_template is None
    assert tok.encode("") == [1]
    assert tok.encode("", add_special_tokens=False) == []


def test_gguf_byte_fallback(tok: Tokenizer) -> None:
    ids = tok.encode("a\nb\tc", add_special_tokens=False)
    assert 13 in ids and 12 in ids  # <0x0A>, <0x09>
    # Characters without a piece become their UTF-8 bytes (byte b has id b + 3).
    for ch in ("ï", "😀", "中"):
        ids = tok.encode(ch, add_special_tokens=False)
        assert ids[-len(ch.encode()) :] == [b + 3 for b in ch.encode()]
        assert tok.decode(ids) == ch


def test_gguf_special_tokens(tok: Tokenizer) -> None:
    # Control tokens in text are matched whole; the prefix space is added after them too (llama.cpp).
    assert tok.encode("<s>x</s>", add_special_tokens=False)[0] == 1
    assert tok.encode("<s>x</s>", add_special_tokens=False)[-1] == 2
    assert tok.decode([1, 403, 2]) == "Once"
    assert tok.decode([1, 403, 2], skip_special_tokens=False) == "<s> Once</s>"
    assert tok.special_token_ids == frozenset({0, 1, 2})
    assert tok.byte_token_ids == frozenset(range(3, 259))


def test_gguf_matches_transformers_conversion(tok: Tokenizer, reader: gguf.GGUFReader) -> None:
    """Same ids as transformers' own GGUF tokenizer conversion (built from the same metadata:
    `AutoTokenizer.from_pretrained(gguf_file=...)` itself fails on this file's 0xFFFFFFFF pad id).
    Texts starting with whitespace differ on purpose: transformers' Metaspace does not prepend "▁"
    to text that already starts with a space, llama.cpp and SentencePiece do (and we follow them)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    if not hasattr(mapping, "sentencepiece_tokenizer"):
        pytest.skip("transformers has no sentencepiece GGUF builder")

    def numbers(key: str) -> list:
        field = reader.fields[key]
        return [field.parts[i][0].item() for i in field.data]

    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    spec = {
        "tokenizer_type": "llama",
        "tokens": tokens,
        "scores": numbers("tokenizer.ggml.scores"),
        "token_type": numbers("tokenizer.ggml.token_type"),
    }
    ref = mapping.add_gguf_special_tokens(mapping.sentencepiece_tokenizer(spec), spec)
    ours = json.loads(tok.backend.to_str())["model"]["merges"]
    assert ours == json.loads(ref.backend_tokenizer.to_str())["model"]["merges"]
    for text in _random_texts(400):
        text = text.lstrip()
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=150, deadline=None, database=None)
@given(st.text(alphabet=st.characters(blacklist_characters="▁<", blacklist_categories=("Cs",)), max_size=40))
def test_gguf_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == 1
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


# ---------------------------------------------------------------------- HF directory


def _write_hf_dir(tok: Tokenizer, path: Path, *, config: dict | None = None, post_processor: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    data = json.loads(tok.backend.to_str())
    if not post_processor:
        data["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    added = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"content": "<s>", **added},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        **(config or {}),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def auto_tokenizer():
    import transformers

    return transformers.AutoTokenizer


def test_hf_dir_matches_auto_tokenizer(tok: Tokenizer, tmp_path: Path, auto_tokenizer) -> None:
    path = _write_hf_dir(tok, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 512}))
    ours = Tokenizer.from_pretrained_dir(path)
    ref = auto_tokenizer.from_pretrained(str(path))
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_ids == frozenset({2, 5})
    assert ours.vocab_size == 512
    assert ours.add_bos_token is True
    for text in _random_texts(60, seed=1):
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("config", [{}, {"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}])
@pytest.mark.parametrize("post_processor", [True, False])
def test_hf_dir_bos_follows_post_processor(
    tok: Tokenizer, tmp_path: Path, auto_tokenizer, config: dict, post_processor: bool
) -> None:
    path = _write_hf_dir(tok, tmp_path / "m", config=config, post_processor=post_processor)
    ours = Tokenizer.from_pretrained_dir(path)
    ref = auto_tokenizer.from_pretrained(str(path))
    text = "Once upon a time"
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.add_bos_token == (ours.encode(text)[:1] == [1]) == post_processor


def test_hf_chat_template_matches_transformers(tok: Tokenizer, tmp_path: Path, auto_tokenizer) -> None:
    path = _write_hf_dir(tok, tmp_path / "m")
    ours = Tokenizer.from_pretrained_dir(path)
    ref = auto_tokenizer.from_pretrained(str(path))
    assert ours.chat_template == CHAT_TEMPLATE
    for messages in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ref_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert ours.encode_chat(messages, add_generation_prompt=gen) == list(ref_ids)
            assert ours.encode(text, add_special_tokens=False) == list(ref_ids)
            # The template writes BOS itself: exactly one BOS when encoded the documented way.
            assert list(ref_ids).count(1) == 1 and ref_ids[0] == 1
    with pytest.raises(jinja2.TemplateError, match="Unknown role"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])


def test_hf_chat_template_jinja_file_wins(tok: Tokenizer, tmp_path: Path, auto_tokenizer) -> None:
    path = _write_hf_dir(tok, tmp_path / "m")
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", encoding="utf-8"
    )
    ours = Tokenizer.from_pretrained_dir(path)
    ref = auto_tokenizer.from_pretrained(str(path))
    assert ours.apply_chat_template(CHATS[1]) == ref.apply_chat_template(CHATS[1], tokenize=False)


def test_hf_dir_chat_template_list_and_minimal_config(tok: Tokenizer, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]
    path = _write_hf_dir(tok, tmp_path / "m", config={"chat_template": named})
    assert Tokenizer.from_pretrained_dir(path).apply_chat_template(CHATS[0]) == "D1"
    # No bos/eos in tokenizer_config: fall back to config.json ids.
    path = tmp_path / "bare"
    path.mkdir()
    (path / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    (path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))
    bare = Tokenizer.from_pretrained_dir(path)
    assert bare.bos_token_id == 1 and bare.eos_token_ids == frozenset({2})
    assert bare.chat_template is None


# ---------------------------------------------------------------------- fallback chat template


def test_fallback_chat_template(tok: Tokenizer) -> None:
    assert "<|role|>" not in FALLBACK_CHAT_TEMPLATE
    text = tok.apply_chat_template(CHATS[1])
    assert text == (
        "<s><|system|>\nYou are kind.\n<|user|>\n  Hi there  \n"
        "<|assistant|>\nOnce upon a time\n<|user|>\nMore, please!\nThanks.\n<|assistant|>\n"
    )
    assert not tok.apply_chat_template(CHATS[0], add_generation_prompt=False).endswith("<|assistant|>\n")
    ids = tok.encode_chat(CHATS[0])
    assert ids[0] == 1 and ids.count(1) == 1
    # Encoding chat text with add_special_tokens=True would double the BOS: the documented way avoids it.
    assert tok.encode(tok.apply_chat_template(CHATS[0]))[:2] == [1, 1]


# ---------------------------------------------------------------------- byte-level dummy vocab


def test_byte_level_layout() -> None:
    tok = Tokenizer.byte_level(300)
    assert tok.vocab_size == 300
    assert tok.bos_token_id == 1 and tok.eos_token_ids == frozenset({2}) and tok.add_bos_token
    assert tok.encode("Hé") == [1, ord("H") + 3, 0xC3 + 3, 0xA9 + 3]
    assert tok.decode([259, 260, 299]) == " w259 w260 w299"
    assert tok.decode(list(range(3, 3 + 128))) == "".join(map(chr, range(128)))
    # A run of byte tokens that is not valid UTF-8 decodes to one U+FFFD per byte (tokenizers' ByteFallback).
    assert tok.decode(list(range(300)), skip_special_tokens=False).startswith("<unk><s></s>\ufffd\ufffd")
    for i in range(300):  # never crashes, always deterministic
        assert tok.decode([i]) == tok.decode([i])
    assert tok.encode_chat(CHATS[0])[0] == 1


@settings(max_examples=100, deadline=None, database=None)
@given(
    st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=30),
    st.sampled_from([259, 512, 4096]),
)
def test_byte_level_round_trip(text: str, vocab_size: int) -> None:
    tok = Tokenizer.byte_level(vocab_size)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [b + 3 for b in text.encode()]
    assert tok.decode(ids) == text


def test_byte_level_small_vocab() -> None:
    tok = Tokenizer.byte_level(64)
    ids = tok.encode("a\n")
    assert all(i < 64 for i in ids) and ids == [1, 0, 13]  # 'a' (id 100) is out of range: <unk>
    assert tok.decode(list(range(64)))
    with pytest.raises(ValueError):
        Tokenizer.byte_level(2)


@needs_stories
def test_exported_tokenizer_loads_in_transformers_and_encodes_the_same(tmp_path: Path, auto_tokenizer) -> None:
    """`travelator export-tokenizer` on the GGUF: transformers' AutoTokenizer reads the
    directory and gives the server's ids, text and chat prompts (the README's ids included)."""
    from travelator.cli import main
    from travelator.model.loader import open_model

    out = tmp_path / "tok"
    assert main(["export-tokenizer", str(STORIES), str(out)]) == 0
    ref = auto_tokenizer.from_pretrained(str(out))
    ours = open_model(str(STORIES)).tokenizer
    assert ref.encode("Once upon a time") == [1, 403, 407, 261, 378]
    rng = random.Random(5)
    texts = ["", " ", "Hello\nworld\t!", "naïve café 🙂", "  two  spaces", "Lily saw a big, red ball."]
    texts += ["".join(rng.choice("ab cdé\n🙂xyz.") for _ in range(rng.randint(1, 30))) for _ in range(40)]
    for text in texts:
        assert ref.encode(text) == ours.encode(text), text
        assert ref.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ref.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a story"}]
    for gen in (True, False):
        assert ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
            ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False) == \
            ours.encode_chat(messages, add_generation_prompt=gen)
