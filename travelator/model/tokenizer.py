"""Tokenizers for every model source, all backed by the Rust `tokenizers` library.

Three sources:

- a Hugging Face model directory (`tokenizer.json` + `tokenizer_config.json`),
- the vocabulary embedded in a GGUF file: llama.cpp's SentencePiece-BPE "llama" vocab, or its
  byte-level BPE "gpt2" vocab with the pre-tokenizer named by `tokenizer.ggml.pre`,
- a synthetic byte-level vocabulary for random-weight ("dummy") models.

Chat prompts: `apply_chat_template` renders text that already holds every special token the
model needs (a template that wants BOS writes `{{ bos_token }}` itself, and the built-in fallback
does the same), so the rendered text must be encoded with `encode(text, add_special_tokens=False)`,
exactly like transformers' `apply_chat_template(..., tokenize=True)`. `encode_chat` does both.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

if TYPE_CHECKING:
    import gguf

__all__ = ["Tokenizer", "FALLBACK_CHAT_TEMPLATE", "GGUF_BPE_PRE_TOKENIZERS"]

logger = logging.getLogger(__name__)

SPIECE_UNDERLINE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

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

#: Used when a model ships no chat template. Each message becomes `<|role|>\ncontent\n`; the
#: generation prompt is `<|assistant|>\n`. `bos_token` is written first when the model adds BOS
#: to plain text (`add_bos_token`), so chat text is always encoded with `add_special_tokens=False`.
FALLBACK_CHAT_TEMPLATE = (
    "{% if add_bos_token and bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    """Text <-> token ids, plus the special ids and chat template of one model."""

    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    vocab_size: int
    chat_template: str | None
    add_bos_token: bool

    def __init__(
        self,
        tokenizer: RustTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        extra_template_vars: Mapping[str, Any] | None = None,
        vocab_size: int | None = None,
        silent_token_ids: Sequence[int] = (),
    ) -> None:
        """Wrap a ready `tokenizers.Tokenizer`; prefer the `from_*` constructors. A `vocab_size`
        below the backend's makes `encode` map the ids above it to the unknown token (id 0).
        `silent_token_ids` decode to nothing (a GGUF vocab's UNUSED tokens, as in llama.cpp)."""
        self._tk = tokenizer
        backend_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = backend_size if vocab_size is None else vocab_size
        self._encode_limit = self.vocab_size if self.vocab_size < backend_size else None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = set(eos_token_ids)
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids = frozenset(eos_ids)
        self.chat_template = chat_template
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        # Byte-fallback pieces (`<0xNN>`): the decoder turns a run of them into text all at once.
        self.byte_token_ids: frozenset[int] = frozenset()
        if _uses_byte_fallback(tokenizer):
            self.byte_token_ids = frozenset(
                i for tok, i in tokenizer.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.match(tok)
            )
        self._silent_ids = frozenset(silent_token_ids)
        self.add_bos_token = self._probe_adds_bos()
        self._template_vars = dict(extra_template_vars or {})
        self._compiled: dict[str, jinja2.Template] = {}

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face layout: `tokenizer.json`, `tokenizer_config.json` and, when present,
        `generation_config.json` / `config.json` (extra EOS ids) and `chat_template.jinja`/`.json`.

        BOS/EOS on `encode(add_special_tokens=True)` are whatever the `tokenizer.json`
        post-processor adds, as in transformers v5 `AutoTokenizer` (which ignores
        `add_bos_token`/`add_eos_token` in `tokenizer_config.json` when a `tokenizer.json` exists);
        `self.add_bos_token` reports the outcome.
        """
        path = Path(path)
        tk = RustTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        if bos is None:
            bos = _id_to_token(tk, gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id")))
        eos_ids: set[int] = set()
        for source in (gen_cfg, model_cfg):
            eos_ids.update(_as_id_list(source.get("eos_token_id")))
        if eos is None and eos_ids:
            eos = _id_to_token(tk, min(eos_ids))
        eos_ids = {i for i in eos_ids if 0 <= i < tk.get_vocab_size(with_added_tokens=True)}

        extra = {k: _token_content(cfg.get(k)) for k in ("unk_token", "pad_token")}
        return cls(
            tk,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=sorted(eos_ids),
            chat_template=_hf_chat_template(path, cfg),
            extra_template_vars={k: v for k, v in extra.items() if v is not None},
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer of the vocabulary in a GGUF file, by `tokenizer.ggml.model`:

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
        fields = reader.fields
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
        bos = tokens[bos_id] if bos_id is not None else None
        eos = tokens[eos_id] if eos_id is not None else None
        tk.post_processor = _template_processor(tk, bos if add_bos else None, eos if add_eos else None)
        # llama.cpp also ends generation on end-of-turn / end-of-message tokens.
        extra_eos = [i for key in ("eot_token_id", "eom_token_id") if (i := special_id(key)) is not None]
        chat_template = _gguf_str(reader, "tokenizer.chat_template") if "tokenizer.chat_template" in fields else None
        return cls(
            tk,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=extra_eos,
            chat_template=chat_template,
            extra_template_vars={"unk_token": unk} if unk is not None else None,
            silent_token_ids=silent,
        )

    @classmethod
    def byte_level(cls, vocab_size: int) -> Tokenizer:
        """A tokenizer for random-weight models without a tokenizer file.

        Ids: 0 `<unk>`, 1 `<s>` (BOS), 2 `</s>` (EOS), 3..258 the 256 bytes (`<0x00>`..`<0xFF>`);
        every id from 259 to `vocab_size - 1` decodes to the placeholder word `" w<id>"`. Text
        encodes to its UTF-8 bytes (any text round-trips). With `vocab_size < 259` the missing
        byte tokens encode as `<unk>`.
        """
        if vocab_size < 3:
            raise ValueError(f"byte_level needs vocab_size >= 3, got {vocab_size}")
        pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        pieces += [f"{SPIECE_UNDERLINE}w{i}" for i in range(len(pieces), vocab_size)]
        vocab = {tok: i for i, tok in enumerate(pieces)}
        tk = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        tk.decoder = decoders.Sequence(
            [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
        tk.post_processor = _template_processor(tk, "<s>", None)
        # Below 259 ids the backend keeps all byte pieces (an unknown byte in the middle of a byte
        # fallback would be reordered by `tokenizers`); `encode` maps ids >= vocab_size to <unk>.
        return cls(
            tk, bos_token="<s>", eos_token="</s>", extra_template_vars={"unk_token": "<unk>"}, vocab_size=vocab_size
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS/EOS as the model's post-processor
        says; use `False` for rendered chat prompts, which already contain them."""
        ids = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        if self._encode_limit is not None:
            ids = [i if i < self._encode_limit else 0 for i in ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids the vocab does not know are skipped."""
        if self._silent_ids:
            ids = [i for i in ids if i not in self._silent_ids]
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocab piece of one id (e.g. `'▁the'`, `'<0x0A>'`), or None."""
        return self._tk.id_to_token(token_id)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """Render `messages` with the model's jinja chat template, like transformers does
        (sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `bos_token`/`eos_token`).

        Without a model template, `FALLBACK_CHAT_TEMPLATE` is used: `<|role|>\\ncontent\\n` per
        message, then `<|assistant|>\\n`, preceded by `bos_token` when the model adds BOS.
        Encode the result with `encode(text, add_special_tokens=False)` (or call `encode_chat`).
        """
        source = self.chat_template if self.chat_template is not None else FALLBACK_CHAT_TEMPLATE
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = _compile_template(source)
        context = {
            **self._template_vars,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "add_bos_token": self.add_bos_token,
            **template_vars,
        }
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any) -> list[int]:
        """`encode(apply_chat_template(...), add_special_tokens=False)`: no double BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_vars)
        return self.encode(text, add_special_tokens=False)

    def save_pretrained(self, path: str | Path, model_max_length: int | None = None) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template in use)
        so that `transformers.AutoTokenizer.from_pretrained(path)` encodes, decodes and renders
        chats exactly as this tokenizer does: what benchmark clients and evaluation harnesses
        load when the model came from a GGUF file or has no hub id."""
        if self._encode_limit is not None:
            raise ValueError(f"the model's vocabulary ({self.vocab_size}) is smaller than its tokenizer's "
                             f"({self._tk.get_vocab_size(with_added_tokens=True)}): an exported tokenizer "
                             "would not encode as the server does")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tk.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(
            json.dumps(self.hf_config(model_max_length), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def hf_config(self, model_max_length: int | None = None) -> dict[str, Any]:
        """The `tokenizer_config.json` of `save_pretrained` (also served as /tokenizer_info):
        special tokens and the chat template in use. transformers passes bos_token and
        eos_token to a template itself; the other variables this tokenizer renders with are
        fixed into the template."""
        fixed = {"add_bos_token": self.add_bos_token, **self._template_vars}
        prelude = "".join(f"{{%- set {k} = {json.dumps(v)} -%}}" for k, v in fixed.items())
        source = self.chat_template if self.chat_template is not None else FALLBACK_CHAT_TEMPLATE
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": None,
            "clean_up_tokenization_spaces": False,
            "chat_template": prelude + source,
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        return config

    # ------------------------------------------------------------------ helpers

    @property
    def backend(self) -> RustTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tk

    def _probe_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        with_special = self._tk.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == self.bos_token_id and (
            self._tk.encode("a", add_special_tokens=False).ids[:1] != [self.bos_token_id]
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, add_bos_token={self.add_bos_token})"
        )


# ---------------------------------------------------------------------- module helpers


def _uses_byte_fallback(tk: RustTokenizer) -> bool:
    return bool(getattr(tk.model, "byte_fallback", False))


def _template_processor(tk: RustTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
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


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox transformers uses."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict (`{"content": ...}`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _id_to_token(tk: RustTokenizer, token_id: Any) -> str | None:
    ids = _as_id_list(token_id)
    return tk.id_to_token(ids[0]) if ids else None


def _hf_chat_template(path: Path, cfg: dict) -> str | None:
    """The default chat template, looked up like transformers: `chat_template.jinja`, else
    `tokenizer_config.json["chat_template"]` (a string, or a list of named templates: "default"),
    else the legacy `chat_template.json`."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


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
