"""The tokenizer backend of the vocabulary in a GGUF file (``Tokenizer.from_gguf``).

llama.cpp's two vocabularies, built the way each is tokenized:

- "llama" (SentencePiece-BPE), the way transformers converts a Llama SentencePiece model:
  BPE with byte fallback, merges derived from the vocab ordered by the score of the merged
  piece, `Prepend("▁")` + `Replace(" ", "▁")` normalizer, and a `▁`->space /
  byte-fallback / fuse / strip-one-leading-space decoder; BOS added unless the file says not.
- "gpt2" (byte-level BPE), the way llama.cpp tokenizes it: the file's merges, the split
  patterns of its `tokenizer.ggml.pre` (`GGUF_BPE_PRE_TOKENIZERS`; none named means
  llama.cpp's "default"), the GPT-2 byte alphabet, no unknown token; BOS added only when
  the file says so or, without the flag, for the Llama 3 family. UNUSED tokens decode to
  nothing.

Both: CONTROL (and UNKNOWN) tokens are special added tokens, matched whole in the text and
dropped by `decode(skip_special_tokens=True)`; USER_DEFINED tokens are plain added tokens,
matched whole and always decoded. `tokenizer.ggml.eot_token_id` / `eom_token_id` are
extra EOS ids (llama.cpp ends generation on them too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

SPIECE_UNDERLINE = "\u2581"

# llama.cpp token types (`tokenizer.ggml.token_type`).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits of byte-level BPE vocabularies, as llama.cpp (src/llama-vocab.cpp) applies
# them: each pattern in turn cuts every piece left by the previous one into its matches and the
# text between them. Contractions are spelled case by case (`'[sS]`), as llama.cpp does, rather
# than with an inline `(?i:...)` group.
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3 (tiktoken cl100k style): numbers in groups of up to three digits.
_LLAMA3_SPLIT = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: the Llama 3 pattern with every digit on its own.
_QWEN2_SPLIT = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _BpePreTokenizer:
    """One `tokenizer.ggml.pre` family: its split patterns, whether a pre-token that is itself in
    the vocab skips the merges (`ignore_merges`), and whether BOS is added to plain text when the
    file has no `tokenizer.ggml.add_bos_token`."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_LLAMA3_PRE = _BpePreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _BpePreTokenizer((_QWEN2_SPLIT,))
_SMOLLM_PRE = _BpePreTokenizer((r"\p{N}", _GPT2_SPLIT))  # StarCoder style: digits alone, then GPT-2
_GPT2_PRE = _BpePreTokenizer((_GPT2_SPLIT,))
_DEFAULT_PRE = _BpePreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))

#: `tokenizer.ggml.pre` names of byte-level ("gpt2") GGUF vocabularies that `Tokenizer.from_gguf`
#: builds. Each name is one llama.cpp treats exactly like the others of its group.
GGUF_BPE_PRE_TOKENIZERS: dict[str, _BpePreTokenizer] = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3_PRE
    ),
    # The Llama 3 split without its two flags.
    **dict.fromkeys(("dbrx", "smaug-bpe"), _BpePreTokenizer((_LLAMA3_SPLIT,))),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "f2llmv2", "solar-open"), _QWEN2_PRE
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"), _SMOLLM_PRE
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "olmo", "jais", "trillion", "exaone4",
                     "granite-docling", "mpt"), _GPT2_PRE),
    "default": _DEFAULT_PRE,
}


@dataclass(frozen=True)
class GgufVocab:
    """What ``Tokenizer`` is made of, read from a GGUF file."""

    backend: RustTokenizer
    bos_token: str | None
    eos_token: str | None
    extra_eos_ids: list[int]  # end-of-turn / end-of-message tokens
    chat_template: str | None
    unk_token: str | None
    silent_token_ids: list[int]  # UNUSED tokens of a byte-level vocab: they decode to nothing


def read_gguf_vocab(reader: gguf.GGUFReader) -> GgufVocab:
    """The backend and special tokens of the vocabulary in a GGUF file, by `tokenizer.ggml.model`."""
    kind = _gguf_str(reader, "tokenizer.ggml.model")
    if kind not in ("llama", "gpt2"):
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'llama' (SentencePiece), "
                         "'gpt2' (byte-level BPE)")
    tokens = _gguf_str_array(reader, "tokenizer.ggml.tokens")
    n = len(tokens)
    types = [int(t) for t in _gguf_num_array(reader, "tokenizer.ggml.token_type")] or [_NORMAL] * n

    def special_id(key: str) -> int | None:
        value = _gguf_scalar(reader, f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < n else None

    bos_id, eos_id, unk_id = special_id("bos_token_id"), special_id("eos_token_id"), special_id("unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    silent: list[int] = []
    if kind == "llama":
        tk = _sentencepiece_backend(reader, tokens, types, unk)
        add_bos_default = True
    else:
        tokens = [tok or f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]  # llama.cpp's name for them
        tk, add_bos_default = _byte_level_backend(reader, tokens)
        silent = [i for i, t in enumerate(types) if t == _UNUSED]
    add_bos = bool(_gguf_scalar(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(_gguf_scalar(reader, "tokenizer.ggml.add_eos_token", False))
    _add_vocab_tokens(tk, tokens, types)
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    tk.post_processor = template_processor(tk, bos if add_bos else None, eos if add_eos else None)
    # llama.cpp also ends generation on end-of-turn / end-of-message tokens.
    extra_eos = [i for key in ("eot_token_id", "eom_token_id") if (i := special_id(key)) is not None]
    chat_template = _gguf_str(reader, "tokenizer.chat_template") if "tokenizer.chat_template" in reader.fields else None
    return GgufVocab(tk, bos, eos, extra_eos, chat_template, unk, silent)


def _add_vocab_tokens(tk: RustTokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL and UNKNOWN tokens as special added tokens, USER_DEFINED ones as plain ones."""
    tk.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, t in zip(tokens, types)
            if t in (_CONTROL, _UNKNOWN)
        ]
    )
    user = [AddedToken(tok, special=False, normalized=False) for tok, t in zip(tokens, types) if t == _USER_DEFINED]
    if user:
        tk.add_tokens(user)


def template_processor(tk: RustTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """`[bos] $A [eos]` (and the transformers-style pair form), like `update_post_processor`."""
    bos = bos if bos is not None and tk.token_to_id(bos) is not None else None
    eos = eos if eos is not None and tk.token_to_id(eos) is not None else None
    b0, e0 = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
    b1, e1 = (f" {bos}:1" if bos else ""), (f" {eos}:1" if eos else "")
    single = f"{b0}$A:0{e0}"
    specials = [(t, tk.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=f"{single}{b1} $B:1{e1}", special_tokens=specials)


def _sentencepiece_backend(
    reader: gguf.GGUFReader, tokens: list[str], types: list[int], unk: str | None
) -> RustTokenizer:
    """The BPE model, normalizer and decoder of a "llama" (SentencePiece) GGUF vocab."""
    scores = _gguf_num_array(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    add_prefix = bool(_gguf_scalar(reader, "tokenizer.ggml.add_space_prefix", True))
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    mergeable = {tok for tok, t in zip(tokens, types) if t in (_NORMAL, _USER_DEFINED, 0)}
    merges = _merges_from_scores(tokens, scores, mergeable, vocab)
    tk = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tk.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE), normalizers.Replace(" ", SPIECE_UNDERLINE)])
        if add_prefix
        else normalizers.Replace(" ", SPIECE_UNDERLINE)
    )
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def _byte_level_backend(reader: gguf.GGUFReader, tokens: list[str]) -> tuple[RustTokenizer, bool]:
    """The BPE model, pre-tokenizer and decoder of a "gpt2" (byte-level BPE) GGUF vocab, and
    whether its pre-tokenizer family adds BOS when the file does not say."""
    name = _gguf_str(reader, "tokenizer.ggml.pre")
    if name is None:
        logger.warning("GGUF byte-level vocab without tokenizer.ggml.pre: splitting text with llama.cpp's "
                       "'default' patterns, which may not be the ones the model was trained with")
        name = "default"
    pre = GGUF_BPE_PRE_TOKENIZERS.get(name)
    if pre is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: "
                         f"{', '.join(sorted(GGUF_BPE_PRE_TOKENIZERS))}")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if (first := vocab.setdefault(tok, i)) != i:
            raise ValueError(f"GGUF vocabulary has the token {tok!r} twice: ids {first} and {i}")
    # A merge is "left right", cut at the first space after its first character. The first
    # occurrence of a pair sets its rank. `tokenizers` refuses merges of unknown pieces, so those
    # (never seen in a well-formed vocab) are left out.
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for merge in _gguf_str_array(reader, "tokenizer.ggml.merges"):
        cut = merge.find(" ", 1)
        pair = (merge[:cut], merge[cut + 1 :])
        if cut > 0 and pair not in seen and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            seen.add(pair)
            merges.append(pair)
    tk = RustTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    return tk, pre.add_bos


def _merges_from_scores(
    tokens: list[str], scores: Sequence[float], mergeable: set[str], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocab: every split of a piece into two known pieces,
    best merged-piece score first (ties ordered like transformers' `generate_merges`)."""
    found = []
    for merged_id, piece in enumerate(tokens):
        if piece not in mergeable or vocab.get(piece) != merged_id:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                key = (-scores[merged_id], -len(left), -len(right), merged_id, vocab[left], vocab[right])
                found.append((key, left, right))
    found.sort(key=lambda item: item[0])
    return [(left, right) for _, left, right in found]


def _gguf_field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields.get(key)


def _gguf_str(reader: gguf.GGUFReader, key: str) -> str | None:
    """A GGUF string field: the bytes live in `field.parts[field.data[0]]`."""
    field = _gguf_field(reader, key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _gguf_str_array(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = _gguf_field(reader, key)
    if field is None:
        raise ValueError(f"GGUF file has no {key!r}")
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _gguf_num_array(reader: gguf.GGUFReader, key: str) -> list:
    field = _gguf_field(reader, key)
    if field is None:
        return []
    return [field.parts[i][0].item() for i in field.data]


def _gguf_scalar(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = _gguf_field(reader, key)
    if field is None:
        return default
    return field.parts[field.data[0]][0].item()
