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
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as RustTokenizer

from travelator.model.gguf_vocab import GGUF_BPE_PRE_TOKENIZERS, SPIECE_UNDERLINE, read_gguf_vocab, template_processor
from travelator.model.model_file_error import ModelFileError

if TYPE_CHECKING:
    import gguf

__all__ = ["Tokenizer", "FALLBACK_CHAT_TEMPLATE", "GGUF_BPE_PRE_TOKENIZERS"]

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

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
        try:
            tk = RustTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise ModelFileError(path / "tokenizer.json", None, f"is not a readable tokenizer: {e}") from None
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
        """Build the tokenizer of the vocabulary in a GGUF file (see model/gguf_vocab.py)."""
        vocab = read_gguf_vocab(reader)
        return cls(
            vocab.backend,
            bos_token=vocab.bos_token,
            eos_token=vocab.eos_token,
            eos_token_ids=vocab.extra_eos_ids,
            chat_template=vocab.chat_template,
            extra_template_vars={"unk_token": vocab.unk_token} if vocab.unk_token is not None else None,
            silent_token_ids=vocab.silent_token_ids,
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
        tk.post_processor = template_processor(tk, "<s>", None)
        # Below 259 ids the backend keeps all byte pieces (an unknown byte in the middle of a byte
        # fallback would be reordered by `tokenizers`); `encode` maps ids >= vocab_size to <unk>.
        return cls(
            tk, bos_token="<s>", eos_token="</s>", extra_template_vars={"unk_token": "<unk>"}, vocab_size=vocab_size
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS/EOS as the model's post-processor
        says; use `False` for rendered chat prompts, which already contain them."""
        # The batch call drops the GIL while it encodes (`encode` holds it: seconds for a
        # megabyte prompt, during which no other thread runs); "fast" skips the offsets.
        ids = self._tk.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
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
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(path, None, f"is not valid JSON: {e}") from None
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
