"""Byte-level BPE ("gpt2") vocabularies of GGUF files: `Tokenizer.from_gguf`.

The real model, SmolLM2-135M-Instruct (pre-tokenizer "smollm"), is checked against two
independent references on a few hundred strings and on every token of its vocabulary:
llama.cpp's own tokenizer (llama-cpp-python, vocabulary only) and transformers' GGUF tokenizer
conversion. llama.cpp defines GGUF, so it must match everywhere; where transformers differs, the
test shows why.

The other pre-tokenizers are checked against llama.cpp on small GGUF files written here, with a
byte-level BPE vocabulary trained on text made to have merges across digits, spaces and
punctuation, so that each pre-tokenizer's splits show in the ids.
"""

from __future__ import annotations

import ctypes
import json
import logging
import random
import unicodedata
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from paths import SMOLLM2, needs_smollm2
from travelator.engine.detokenizer import IncrementalDetokenizer
from travelator.model.tokenizer import GGUF_BPE_PRE_TOKENIZERS, Tokenizer

llama_cpp = pytest.importorskip("llama_cpp")


class LlamaCppVocab:
    """llama.cpp's tokenizer of one GGUF file (llama-cpp-python, vocabulary only, no weights)."""

    def __init__(self, path: Path) -> None:
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self._vocab = self.llama._model.vocab
        self._buf = ctypes.create_string_buffer(4096)
        self._ids = (llama_cpp.llama_token * 4096)()

    def encode(self, text: str, add_special: bool) -> list[int]:
        """`parse_special`: control tokens written in the text are parsed, as `Tokenizer.encode`
        does. (`Llama.tokenize` does the same, but tokenizes twice with a vocabulary-only model.)"""
        data = text.encode()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), self._ids, len(self._ids), add_special, True)
        assert 0 <= n <= len(self._ids)
        return list(self._ids[:n])

    def piece(self, token_id: int, special: bool) -> bytes:
        # `Llama.detokenize` uses a 32-byte buffer and drops a space after BOS: call the C API.
        n = llama_cpp.llama_token_to_piece(self._vocab, token_id, self._buf, len(self._buf), 0, special)
        assert 0 <= n <= len(self._buf)
        return self._buf.raw[:n]

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return b"".join(self.piece(i, not skip_special) for i in ids).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.llama.close()


# ---------------------------------------------------------------------- test strings


def _texts() -> list[str]:
    """A few hundred strings: several scripts, emoji, code, whitespace runs, digits of many lengths,
    contractions, special tokens written in the text, mixed cases."""
    fixed = [
        "", " ", "  ", "\n", "\t", "\r\n", "a", "Hello world", "Hello, world!", "HELLO World hello",
        "  leading and trailing  ", "multiple     spaces   here", "tabs\tand\ttabs\t\t\tend",
        "line one\nline two\n\n\nline five\n", "windows\r\nline\r\n\r\nends", " \n \n\t\n  x",
        "don't", "DON'T", "Don'T", "I'm we're they've she'll he'd it's", "I'LL WE'VE YOU'RE IT'S",
        "rock 'n' roll", "'tis the season", "l'homme d'affaires", "it’s curly", "''quoted''",
        "0", "7", "42", "123", "1234", "12345", "123456", "1234567", "12345678", "123456789",
        "3.14159", "1,234,567.89", "-42 +17 = -25", "x   1", "x\t\t2", "a\n 3", "[1,  2,   3,    4]",
        "2024-06-01T12:34:56Z", "v1.2.3-rc4", "0xDEADBEEF", "1e-10", "50%", "$100", "№5",
        "１２３ fullwidth", "٣٤٥ Arabic-Indic", "x² + y³ = z⁴", "½ ¾ ⅞", "Ⅻ chapters", "①②③",
        "café naïve résumé façade", "Ærøskøbing Straße", "e\u0301 combining", "ﬁ ligature",
        "Ελληνικά γράμματα", "Русский текст, ещё", "עברית", "العربية الفصحى", "हिन्दी भाषा",
        "ภาษาไทย", "中文字符测试", "日本語のテキスト、カタカナ", "한국어 텍스트", "tiếng Việt",
        "😀", "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵 flags", "❤️ heart", "emoji😀inside",
        "non\u00a0breaking", "ideographic\u3000space", "zero\u200bwidth", "soft\u00adhyphen",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nYou are helpful.<|im_end|>", "<|endoftext|>", "<|endoftext|><|endoftext|>",
        "text<|im_end|>more", " <|im_start|> spaced ", "<|im_start", "im_end|>", "<|im_start|user",
        "<file_sep>main.py\n<jupyter_code>x = 1", "<repo_name>a/b", "<s></s><unk>",
        "def f(x):\n    return x ** 2\n", "if (a && b) { return c; }", "for i in range(10):\n\tprint(i)",
        '{"key": [1, 2, 3], "nested": {"a": null}}', "SELECT * FROM t WHERE id = 42;",
        "#include <stdio.h>\nint main() { printf(\"%d\\n\", 42); }", "a->b::c<d>", "x!=y&&z||w",
        "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Users\\name",
        "!!!", "...", "?!?", "—–-", "«guillemets»", "(parens) [brackets] {braces}", "@#$%^&*",
        "CamelCaseWord snake_case_word kebab-case-word", "MiXeD CaSe TeXt", "ALLCAPS", "iPhone eBay",
        "The quick brown fox jumps over the lazy dog.", "Once upon a time, there was a little girl.",
    ]
    rng = random.Random(20240601)
    words = ["the", "The", "THE", "cat", "Über", "naïve", "데이터", "数据", "данные", "δεδομένα",
             "don't", "WON'T", "it's", "x", "foo_bar", "fooBar", "🙂", "🚀", "ok", "Hello"]
    symbols = ["!", "?", ".", ",", ";", ":", "...", "!!", "->", "==", "()", "[]", "{}", "<", ">", "'", '"', "—"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user", "<|im_start|>assistant\n"]
    seps = ["", " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n", "\u00a0"]

    def fragment() -> str:
        kind = rng.random()
        if kind < 0.35:
            return rng.choice(words)
        if kind < 0.6:
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 20)))
        if kind < 0.8:
            return rng.choice(symbols)
        if kind < 0.9:
            return rng.choice(specials)
        return rng.choice(fixed[60:120])

    generated = []
    for _ in range(280):
        parts = [fragment() for _ in range(rng.randint(1, 7))]
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(seps) + part
        generated.append(text)
    return list(dict.fromkeys(fixed + generated))


TEXTS = _texts()


def _has_space_before_number(text: str) -> bool:
    return any(a.isspace() and unicodedata.category(b).startswith("N") for a, b in zip(text, text[1:]))


def _mismatches(texts, ours, ref) -> list[tuple[str, object, object]]:
    return [(t, a, b) for t, a, b in zip(texts, ours, ref) if a != b]


# ---------------------------------------------------------------------- SmolLM2 (the real model)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(SMOLLM2)))


@pytest.fixture(scope="module")
def smol_llama():
    ref = LlamaCppVocab(SMOLLM2)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def smol_hf():
    """transformers' GGUF tokenizer conversion (`convert_gguf_tokenizer`). `AutoTokenizer.
    from_pretrained(dir, gguf_file=name)` builds the very same backend (same `to_str()`), but first
    reads the whole file once more for the model config (7 s here); the generic fast class skips
    that."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)


@needs_smollm2
def test_smollm2_metadata(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smol.bos_token_id == 1 and smol.eos_token_ids == frozenset({2})
    assert smol.add_bos_token is False  # tokenizer.ggml.add_bos_token = false
    assert smol.special_token_ids == frozenset(range(17))  # the 17 CONTROL tokens
    assert smol.byte_token_ids == frozenset()
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    ids = smol.encode_chat([{"role": "user", "content": "Hi"}])
    assert smol.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == 1 and ids.count(2) == 2


@needs_smollm2
@pytest.mark.parametrize("add_special", [False, True])
def test_smollm2_encode_matches_llama_cpp(smol: Tokenizer, smol_llama: LlamaCppVocab, add_special: bool) -> None:
    ours = [smol.encode(t, add_special_tokens=add_special) for t in TEXTS]
    ref = [smol_llama.encode(t, add_special) for t in TEXTS]
    assert len(TEXTS) > 300
    assert _mismatches(TEXTS, ours, ref)[:5] == []


@needs_smollm2
def test_smollm2_decode_matches_both_references(smol: Tokenizer, smol_llama: LlamaCppVocab, smol_hf) -> None:
    ids = [smol_llama.encode(t, False) for t in TEXTS]
    for skip in (True, False):
        ours = [smol.decode(i, skip_special_tokens=skip) for i in ids]
        assert _mismatches(TEXTS, ours, [smol_llama.decode(i, skip) for i in ids])[:5] == []
        assert _mismatches(TEXTS, ours, smol_hf.batch_decode(ids, skip_special_tokens=skip))[:5] == []
        if not skip:
            assert ours == TEXTS  # every string round-trips


@needs_smollm2
def test_smollm2_transformers_lacks_the_digit_split(smol: Tokenizer, smol_llama: LlamaCppVocab, smol_hf) -> None:
    """The two references disagree, and llama.cpp is followed. transformers 5 has no "smollm"
    pre-tokenizer: it keeps GPT2Tokenizer's GPT-2 split, without the split of every digit that
    llama.cpp applies first (as SmolLM2's own tokenizer.json does: `Digits(individual_digits=True)`
    before `ByteLevel`). SmolLM2's merges never join a digit to anything, so this only shows where
    whitespace stands before a digit: in "x   1" the digit cut leaves "x", "   ", "1" (one token
    for the three spaces), the GPT-2 split alone gives "x", "  ", " 1" (then "Ġ" and "1")."""
    ours = [smol.encode(t, add_special_tokens=False) for t in TEXTS]
    hf = smol_hf(TEXTS, add_special_tokens=False)["input_ids"]
    ref = [smol_llama.encode(t, False) for t in TEXTS]
    assert ours == ref
    differ = [t for t, a, b in _mismatches(TEXTS, hf, ref)]
    assert "x   1" in differ and len(differ) > 20
    assert all(_has_space_before_number(t) for t in differ)
    # With SmolLM2's own pre-tokenizer, transformers' conversion agrees on every string.
    fixed = RustTokenizer.from_str(smol_hf.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert _mismatches(TEXTS, [e.ids for e in fixed.encode_batch(TEXTS, add_special_tokens=False)], ref) == []


@needs_smollm2
def test_smollm2_every_vocab_token(smol: Tokenizer, smol_llama: LlamaCppVocab, smol_hf) -> None:
    """Every id decoded alone (both ways of treating special tokens) by the three, then the text
    of every token (control tokens written out) encoded by the three."""
    n = smol.vocab_size
    assert n == smol_llama.llama.n_vocab() == len(smol_hf)
    for skip in (True, False):
        ref = [smol_llama.decode([i], skip) for i in range(n)]
        ours = [smol.decode([i], skip_special_tokens=skip) for i in range(n)]
        hf = smol_hf.batch_decode([[i] for i in range(n)], skip_special_tokens=skip)
        assert _mismatches(range(n), ours, ref)[:5] == []
        assert _mismatches(range(n), ours, hf)[:5] == []
    texts = ref  # skip=False: "<|im_start|>" etc. written out; pieces of a character come out as U+FFFD
    assert sum("\ufffd" in t for t in texts) > 100
    ours_ids = [e.ids for e in smol.backend.encode_batch(texts, add_special_tokens=False)]
    assert _mismatches(texts, ours_ids, [smol_llama.encode(t, False) for t in texts])[:5] == []
    # No vocabulary token holds a digit beside anything else, so the digit split is invisible here.
    assert _mismatches(texts, ours_ids, smol_hf(texts, add_special_tokens=False)["input_ids"])[:5] == []
    whole = sum(ids == [i] for i, ids in enumerate(ours_ids))
    assert whole > 0.95 * n  # nearly every token's text is that token again


@needs_smollm2
def test_smollm2_streams_split_characters(smol: Tokenizer) -> None:
    """Byte-level tokens can end inside a UTF-8 character: the incremental detokenizer holds such
    text back and never streams U+FFFD for a character that later tokens complete."""
    texts = ["Emoji: 😀👍🏽👨‍👩‍👧 and 中文字符测试，日本語のテキスト。", "🇫🇷🇯🇵 ❤️ 한국어 ภาษาไทย " * 3]
    for text in texts:
        ids = smol.encode(text, add_special_tokens=False)
        assert any("\ufffd" in smol.decode([i]) for i in ids)  # some token is part of a character
        for prompt in ([], smol.encode("Say:", add_special_tokens=False)):
            for step in (1, 2, 3):
                detok = IncrementalDetokenizer(smol, prompt_token_ids=prompt)
                streamed = ""
                for k in range(0, len(ids), step):
                    assert detok.add_tokens(ids[k : k + step]) is None
                    delta = detok.take_delta()
                    assert "\ufffd" not in delta
                    streamed += delta
                streamed += detok.flush()
                assert streamed == text == detok.output_text


@needs_smollm2
def test_smollm2_stop_string_inside_split_characters(smol: Tokenizer) -> None:
    ids = smol.encode("ok 😀😃 end", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, stop=["😃"])
    streamed, stop = "", None
    for tid in ids:
        stop = detok.add_tokens([tid])
        streamed += detok.take_delta()
        if stop:
            break
    assert stop == "😃"
    assert streamed + detok.flush() == "ok 😀"


# ---------------------------------------------------------------------- written GGUF files

_SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<think>"]  # ids 0..3
_CONTROL_IDS, _USER_ID = (0, 1, 2), 3
_PADS = ["[PAD0]", "[PAD1]"]  # UNUSED, at the end of the vocabulary
# A word in the vocabulary that no merge makes: one token only where a whole pre-token found in
# the vocabulary skips the merges (llama.cpp's `ignore_merges`, the Llama 3 family).
_WORD = "zyzzyva"


def _training_text() -> list[str]:
    rng = random.Random(7)
    numbers = ["12345678", "2024", "1999", "31415926", "100000", "42", "987654321", "65536"]
    words = ["the", "The", "cat", "sat", "on", "mat", "don't", "DON'T", "we're", "It'S", "hello", "world",
             "'Tis", "'tis", "DON'TS", "It'Sok", "'REally",
             "café", "Straße", "数据", "данные", "😀", "return", "self", "print", "value"]
    lines = []
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(2, 10)):
            r = rng.random()
            if r < 0.3:
                parts.append(rng.choice(numbers))
            elif r < 0.4:
                parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9))))
            elif r < 0.8:
                parts.append(rng.choice(words))
            else:
                parts.append(rng.choice(["!!", "...", "?", ",", "(", ")", "->", "==", "'", ":", "{", "}"]))
        text = parts[0]
        for p in parts[1:]:
            text += rng.choice([" ", " ", " ", "  ", "   ", "\t", "", "\n", "\n\n", "\n  "]) + p
        lines.append(text)
    return lines


@pytest.fixture(scope="module")
def small_vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a byte-level BPE trained with pieces as long as a line,
    so that merges join digits across groups of three, spaces to digits, punctuation to letters."""
    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\n+|[^\n]+"), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_training_text(), trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + ["Ġ" + _WORD] + _PADS
    assert tokens[: len(_SPECIAL)] == _SPECIAL
    types = [1] * len(tokens)
    for i in _CONTROL_IDS:
        types[i] = 3
    types[_USER_ID] = 4
    types[-len(_PADS) :] = [5] * len(_PADS)
    merges = [" ".join(m) for m in model["merges"]]
    return tokens, types, merges


def _write_gguf(path: Path, vocab, pre: str | None, *, add_bos: bool | None = None, model: str = "gpt2",
                eot: int | None = None, template: str | None = None) -> Path:
    tokens, types, merges = vocab
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if eot is not None:
        w.add_eot_token_id(eot)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _pair(path: Path) -> tuple[Tokenizer, LlamaCppVocab]:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(path))), LlamaCppVocab(path)


_SMALL_TEXTS = TEXTS[::2] + [
    "12345678", "x   12345678", "a\n\n\n  1999", "<|user|>hi<|assistant|>", "<think>why</think>",
    "DON'T It'S we're", "'Tis DON'TS It'Sok 'REally 'tis", "hello!!...world", "[PAD0] [PAD1]", "  \n  \t\n",
    "value->self", f"a {_WORD}", f"{_WORD} {_WORD}s",
]

_FAMILIES = ("llama-bpe", "qwen2", "smollm", "gpt-2", "default")


@pytest.mark.parametrize("pre", [*sorted(GGUF_BPE_PRE_TOKENIZERS), None])
def test_pre_tokenizer_matches_llama_cpp(pre: str | None, small_vocab, tmp_path: Path, caplog) -> None:
    """Every supported `tokenizer.ggml.pre` name, and none (llama.cpp's "default", with a warning)."""
    with caplog.at_level(logging.WARNING):
        ours, ref = _pair(_write_gguf(tmp_path / "v.gguf", small_vocab, pre))
    assert ("tokenizer.ggml.pre" in caplog.text) is (pre is None)
    try:
        for add_special in (False, True):
            encoded = [ours.encode(t, add_special_tokens=add_special) for t in _SMALL_TEXTS]
            assert _mismatches(_SMALL_TEXTS, encoded, [ref.encode(t, add_special) for t in _SMALL_TEXTS])[:5] == []
        n = ours.vocab_size
        for skip in (True, False):
            assert _mismatches(range(n), [ours.decode([i], skip) for i in range(n)],
                               [ref.decode([i], skip) for i in range(n)])[:5] == []
    finally:
        ref.close()


@pytest.fixture(scope="module")
def families(small_vocab, tmp_path_factory) -> dict[str, Tokenizer]:
    folder = tmp_path_factory.mktemp("families")
    return {
        name: Tokenizer.from_gguf(gguf.GGUFReader(str(_write_gguf(folder / f"{name}.gguf", small_vocab, name))))
        for name in _FAMILIES
    }


def test_pre_tokenizer_choice_matters(families: dict[str, Tokenizer]) -> None:
    def pieces(name: str, text: str) -> list[str]:
        tok = families[name]
        return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]

    digits = "12345678"
    assert all("".join(pieces(name, digits)) == digits for name in _FAMILIES)
    assert max(map(len, pieces("gpt-2", digits))) > 3  # one pre-token: merges run over all eight
    assert pieces("qwen2", digits) == pieces("smollm", digits) == list(digits)  # one digit each

    def cuts(ps: list[str]) -> set[int]:
        return {sum(map(len, ps[:k])) for k in range(1, len(ps))}

    for name in ("llama-bpe", "default"):  # groups of at most three: cut after the 3rd and 6th digit
        assert {3, 6} <= cuts(pieces(name, digits)) and max(map(len, pieces(name, digits))) <= 3
    # Only the Llama 3 family takes a pre-token found whole in the vocabulary as it is.
    assert len(families["llama-bpe"].encode(f" {_WORD}", add_special_tokens=False)) == 1
    assert len(families["qwen2"].encode(f" {_WORD}", add_special_tokens=False)) > 1
    # Contractions: any case in the Llama 3 and Qwen2 splits, lower case only in the GPT-2 one.
    assert pieces("qwen2", "'Tis")[0] == pieces("llama-bpe", "'Tis")[0] == "'T"
    assert pieces("gpt-2", "'Tis")[0] != "'T" and pieces("gpt-2", "'tis")[0] == "'t"
    # Every two of the five split some of the test strings differently.
    ids = {name: [tok.encode(t, add_special_tokens=False) for t in _SMALL_TEXTS] for name, tok in families.items()}
    for i, a in enumerate(_FAMILIES):
        for b in _FAMILIES[i + 1 :]:
            assert ids[a] != ids[b], (a, b)


def test_unknown_pre_tokenizer_is_a_clear_error(small_vocab, tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "v.gguf", small_vocab, "no-such-pre")
    with pytest.raises(ValueError, match=r"unsupported GGUF pre-tokenizer 'no-such-pre'.*llama-bpe.*smollm"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


def test_unknown_tokenizer_model_lists_the_supported_ones(small_vocab, tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "v.gguf", small_vocab, "gpt-2", model="bert")
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'bert'.*'llama'.*'gpt2'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


@pytest.mark.parametrize(
    ("pre", "add_bos", "expected"),
    [
        ("llama-bpe", None, True),  # the Llama 3 family adds BOS unless the file says not
        ("llama-bpe", False, False),
        ("smollm", None, False),  # every other byte-level vocab only when the file says so
        ("qwen2", None, False),
        ("qwen2", True, True),
    ],
)
def test_bos_follows_llama_cpp(pre: str, add_bos: bool | None, expected: bool, small_vocab, tmp_path: Path) -> None:
    ours, ref = _pair(_write_gguf(tmp_path / "v.gguf", small_vocab, pre, add_bos=add_bos))
    try:
        assert ours.add_bos_token is expected
        assert ours.encode("hi there") == ref.encode("hi there", True)
        assert ours.encode("hi there")[:1] == ([1] if expected else ours.encode("hi there", False)[:1])
        assert ours.encode("hi there", add_special_tokens=False) == ref.encode("hi there", False)
    finally:
        ref.close()


def test_token_types(small_vocab, tmp_path: Path) -> None:
    tokens = small_vocab[0]
    ours, ref = _pair(_write_gguf(tmp_path / "v.gguf", small_vocab, "qwen2", eot=2, template="{{ messages }}"))
    try:
        assert ours.special_token_ids == frozenset(_CONTROL_IDS)  # CONTROL: special
        assert ours.eos_token_ids == frozenset({0, 2})  # eos_token_id, eot_token_id
        assert ours.bos_token == "<|user|>" and ours.chat_template == "{{ messages }}"
        # USER_DEFINED: matched whole in the text, and kept by decode even when skipping specials.
        text = "a<think>b<|user|>c"
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, False) and _USER_ID in ids and 1 in ids
        assert ours.decode(ids) == ref.decode(ids, True) == "a<think>bc"
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, False) == text
        # UNUSED: decodes to nothing, whether special tokens are skipped or not.
        pads = [len(tokens) - 2, len(tokens) - 1]
        for skip in (True, False):
            assert ours.decode([5, *pads, 6], skip) == ref.decode([5, *pads, 6], skip) == ours.decode([5, 6], skip)
    finally:
        ref.close()


def test_vocabulary_oddities_as_llama_cpp(small_vocab, tmp_path: Path) -> None:
    tokens, types, merges = small_vocab
    # An empty token is named "[EMPTY_<id>]".
    empty = _write_gguf(tmp_path / "empty.gguf", ([*tokens, ""], [*types, 1], merges), "gpt-2")
    ours, ref = _pair(empty)
    try:
        last = len(tokens)
        assert ours.id_to_token(last) == f"[EMPTY_{last}]"
        assert ours.decode([5, last]) == ref.decode([5, last], True) == ours.decode([5]) + f"[EMPTY_{last}]"
    finally:
        ref.close()
    # A token listed twice: llama.cpp refuses the file ("duplicate token in vocabulary"; the build
    # in llama-cpp-python aborts the process on an assertion instead, so it is not called here).
    twice = _write_gguf(tmp_path / "twice.gguf", ([*tokens, tokens[300]], [*types, 1], merges), "gpt-2")
    with pytest.raises(ValueError, match=r"has the token .* twice: ids 300 and"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(twice)))
