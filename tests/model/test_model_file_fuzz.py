"""Damaged model files against the loaders: from a small valid GGUF file and a small valid HF
directory (safetensors, config.json, tokenizer.json), many corrupt copies, made with a seeded
RNG and by hand: truncations at offsets in every section, flipped bytes, absurd shapes and
counts written into the binary layout, config values of the wrong type or range, a tokenizer
cut in half. Loading each one (open_model, then its weights into the model) raises
ModelFileError naming the file, or, where the damage leaves a loadable file (a byte of tensor
data), loads; nothing else, and memory stays bounded.

The loads run in one child process whose address space is capped a fixed margin above what it
holds once ready: an allocation sized by a damaged count fails there as a MemoryError, which
fails the test like any other unexpected exception."""

from __future__ import annotations

import json
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_files import VOCAB, add_vocab, finish
from hf_models import build_checkpoint

SEED = 47
HEADROOM = 512 << 20  # bytes of address space the loads may take beyond the child's start

# The child: cap the address space, then load each path given on stdin (one per line) and print
# one JSON line per path: "ok", or the exception's type, message and, for ModelFileError, field.
_CHILD = r"""
import json, resource, sys
import torch
from travelator.model.llama import LlamaModel
from travelator.model.loader import open_model
from travelator.model.model_file_error import ModelFileError

torch.set_num_threads(1)

def load(path):
    source = open_model(path)
    model = LlamaModel(source.arch, torch.float32, max_positions=64)
    model.load_weights(source.weights(), source=source.name)

paths = sys.stdin.read().split("\n")
load(paths[0])  # a valid file first: what a load itself needs is mapped before the cap
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[1]), resource.RLIM_INFINITY))
for path in paths[1:]:
    try:
        load(path)
        out = {"outcome": "ok"}
    except ModelFileError as e:
        out = {"outcome": "ModelFileError", "message": str(e), "file": e.path, "field": e.field}
    except BaseException as e:
        out = {"outcome": type(e).__name__, "message": str(e)[:300]}
    print(json.dumps(out), flush=True)
"""


@dataclass
class Variant:
    path: Path
    what: str  # the damage, for the failure message
    may_load: bool = False  # damage that can leave a loadable file
    file: str | None = None  # the file the error must name (default: the model's path)
    field: str | None = None  # a substring of the field the error must name


def _load_all(valid: Path, variants: list[Variant]) -> list[dict]:
    stdin = "\n".join(str(p) for p in [valid, *(v.path for v in variants)])
    run = subprocess.run([sys.executable, "-c", _CHILD, str(HEADROOM)], input=stdin, capture_output=True,
                         text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(variants), run.stderr[-3000:]
    return results


def _check(valid: Path, variants: list[Variant]) -> None:
    bad = []
    for v, r in zip(variants, _load_all(valid, variants)):
        if r["outcome"] == "ok" and v.may_load:
            continue
        if r["outcome"] != "ModelFileError":
            bad.append(f"{v.what}: {r['outcome']}: {r.get('message')}")
            continue
        want_file = v.file or str(v.path)
        if not r["file"].startswith(want_file) or want_file not in r["message"]:
            bad.append(f"{v.what}: names {r['file']}, not {want_file}: {r['message']}")
        if v.field is not None and v.field not in (r["field"] or ""):
            bad.append(f"{v.what}: names field {r['field']!r}, not {v.field!r}: {r['message']}")
    assert not bad, f"{len(bad)} of {len(variants)} damaged files:\n" + "\n".join(bad[:30])


# ---- GGUF ----------------------------------------------------------------------------------
def _write_gguf(path: Path, ffn_key: int = 64) -> Path:
    """A llama GGUF of 2 layers (hidden 32, 4 heads, 2 KV heads, intermediate 64), random F32
    weights but one Q8_0 projection; ``ffn_key``: the intermediate size its metadata states."""
    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_feed_forward_length(ffn_key)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab(w)
    shapes = {"token_embd.weight": (VOCAB, 32), "output_norm.weight": (32,), "output.weight": (VOCAB, 32)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm.weight": (32,), f"blk.{i}.ffn_norm.weight": (32,),
                   f"blk.{i}.attn_q.weight": (32, 32), f"blk.{i}.attn_k.weight": (16, 32),
                   f"blk.{i}.attn_v.weight": (16, 32), f"blk.{i}.attn_output.weight": (32, 32),
                   f"blk.{i}.ffn_gate.weight": (64, 32), f"blk.{i}.ffn_up.weight": (64, 32),
                   f"blk.{i}.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.ffn_up.weight":
            w.add_tensor(name, gguf.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    finish(w)
    return path


@dataclass
class _GgufLayout:
    """Where a GGUF file's parts are: byte offsets, as its reader found them."""
    kv_start: int
    infos_start: int
    data_start: int
    value_at: dict[str, int]  # a metadata key -> where its value (after the type) starts
    info_at: dict[str, int]  # a tensor -> where its info starts


def _layout(path: Path) -> _GgufLayout:
    r = gguf.GGUFReader(str(path))
    fields = [f for name, f in r.fields.items() if not name.startswith("GGUF.")]
    value_at = {f.name: f.offset + 8 + len(f.name.encode()) + 4 for f in fields}
    info_at = {t.name: t.field.offset for t in r.tensors}
    return _GgufLayout(24, min(info_at.values()), int(r.data_offset), value_at, info_at)


def _gguf_variants(valid: Path, out: Path) -> list[Variant]:
    blob = valid.read_bytes()
    lay = _layout(valid)
    rng = random.Random(SEED)
    variants: list[Variant] = []

    def add(what: str, data: bytes, **kw) -> None:
        path = out / f"v{len(variants):03d}.gguf"
        path.write_bytes(data)
        variants.append(Variant(path, what, **kw))

    def patched(at: int, fmt: str, *values) -> bytes:
        b = bytearray(blob)
        struct.pack_into(fmt, b, at, *values)
        return bytes(b)

    sections = {"header": (0, lay.kv_start), "kv": (lay.kv_start, lay.infos_start),
                "infos": (lay.infos_start, lay.data_start), "data": (lay.data_start, len(blob))}
    for name, (lo, hi) in sections.items():
        cuts = {lo, hi - 1, *(rng.randrange(lo, hi) for _ in range(12 if name != "header" else 6))}
        for cut in sorted(cuts):
            add(f"truncated in the {name} at {cut}", blob[:cut])
    for name, (lo, hi) in sections.items():
        for _ in range(25 if name != "header" else 8):
            at, b = rng.randrange(lo, hi), bytearray(blob)
            b[at] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
            add(f"byte {at} in the {name} changed", bytes(b), may_load=name in ("kv", "data"))

    add("tensor count 2**50", patched(8, "<Q", 2**50), field="tensor_count")
    add("KV count 2**60", patched(16, "<Q", 2**60), field="kv_count")
    add("first key 2**62 bytes long", patched(24, "<Q", 2**62), field="key")
    tokens = lay.value_at["tokenizer.ggml.tokens"]
    add("token array of 2**60 strings", patched(tokens + 4, "<Q", 2**60), field="tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):  # numbers: the reader never ends
        add(f"{key} of 2**60 items", patched(lay.value_at[key] + 4, "<Q", 2**60), field=key)
    add("a token 2**40 bytes long", patched(tokens + 12, "<Q", 2**40), field="tokenizer.ggml.tokens")
    add("tokens typed as an array of arrays", patched(tokens, "<I", int(gguf.GGUFValueType.ARRAY)),
        field="tokenizer.ggml.tokens")
    add("tokens typed as floats", patched(tokens, "<I", int(gguf.GGUFValueType.FLOAT32)))
    add("unknown value type", patched(lay.value_at["llama.block_count"] - 4, "<I", 99), field="llama.block_count")
    for key, value in (("llama.embedding_length", 0xFFFFFFFF), ("llama.block_count", 0xFFFFFFFF),
                       ("llama.feed_forward_length", 0xFFFFFFFF), ("llama.context_length", 0xFFFFFFFF),
                       ("llama.attention.head_count", 0), ("llama.attention.head_count_kv", 3)):
        add(f"{key} = {value}", patched(lay.value_at[key], "<I", value))
    # In range, but more weights than the file holds: 3 GB of MLP to allocate.
    add("llama.feed_forward_length = 2**22", patched(lay.value_at["llama.feed_forward_length"], "<I", 2**22))
    add("embedding_length typed as a float", patched(lay.value_at["llama.embedding_length"] - 4, "<I",
                                                     int(gguf.GGUFValueType.FLOAT32)), field="llama.embedding_length")
    add("general.architecture unknown", patched(lay.value_at["general.architecture"] + 8, "<5s", b"llamb"),
        field="general.architecture")
    embd = lay.info_at["token_embd.weight"] + 8 + len(b"token_embd.weight")  # n_dims, dims, type, offset
    add("token_embd with 2**31 dimensions", patched(embd, "<I", 2**31), field="token_embd.weight")
    add("token_embd of 2**40 x 32 numbers", patched(embd + 12, "<Q", 2**40), field="token_embd.weight")
    add("token_embd of 2**32 x 2**32 numbers (2**64 wraps to 0)",
        patched(embd + 4, "<QQ", 2**32, 2**32), field="token_embd.weight")
    add("token_embd of unknown type", patched(embd + 20, "<I", 1000), field="token_embd.weight")
    add("token_embd at offset 2**63", patched(embd + 24, "<Q", 2**63), field="token_embd.weight")
    add("token_embd at an unaligned offset", patched(embd + 24, "<Q", 4), field="token_embd.weight")
    add("token_embd 31 wide (the config says 32)", patched(embd + 4, "<Q", 31), field="embed_tokens")
    add("empty file", b"")
    add("not GGUF", b"GGUX" + blob[4:], field="header")
    add("version 99", patched(4, "<I", 99), field="version")
    mismatch = _write_gguf(out / "ffn48.gguf", ffn_key=48)
    variants.append(Variant(mismatch, "feed_forward_length 48, tensors of 64", field="mlp"))
    return variants


def test_damaged_gguf_files_raise_model_file_error(tmp_path):
    valid = _write_gguf(tmp_path / "valid.gguf")
    variants = _gguf_variants(valid, tmp_path)
    assert len(variants) > 150
    _check(valid, variants)


# ---- Hugging Face directory ----------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama", num_hidden_layers=1)


def _hf_variants(valid: Path, out: Path) -> list[Variant]:
    rng = random.Random(SEED)
    variants: list[Variant] = []

    def add(what: str, change, **kw) -> None:
        """A copy of the directory, ``change(copy)`` applied."""
        path = out / f"h{len(variants):03d}"
        shutil.copytree(valid, path)
        change(path)
        variants.append(Variant(path, what, **kw))

    weights = (valid / "model.safetensors").read_bytes()
    header_end = 8 + struct.unpack_from("<Q", weights)[0]

    def write_weights(data: bytes):
        return lambda d: (d / "model.safetensors").write_bytes(data)

    cuts = {0, 4, 8, header_end - 1, header_end, len(weights) - 1,
            *(rng.randrange(8, header_end) for _ in range(8)),
            *(rng.randrange(header_end, len(weights)) for _ in range(8))}
    for cut in sorted(cuts):
        add(f"safetensors truncated at {cut}", write_weights(weights[:cut]))
    for region, (lo, hi) in {"header": (0, header_end), "data": (header_end, len(weights))}.items():
        for _ in range(20 if region == "header" else 6):
            at, b = rng.randrange(lo, hi), bytearray(weights)
            b[at] ^= 1 << rng.randrange(8)
            add(f"safetensors byte {at} ({region}) flipped", write_weights(bytes(b)), may_load=True)
    add("safetensors header 2**60 bytes long", write_weights(struct.pack("<Q", 2**60) + weights[8:]))
    header = json.loads(weights[8:header_end])
    name = next(k for k in header if k != "__metadata__")
    for shape in ([2**40, 64], [2**32, 2**32], [-1, 64]):
        h = dict(header, **{name: dict(header[name], shape=shape)})
        raw = json.dumps(h).encode()
        add(f"{name} of shape {shape}", write_weights(struct.pack("<Q", len(raw)) + raw + weights[header_end:]))

    def drop_tensor(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        del tensors["model.layers.0.mlp.down_proj.weight"]
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    add("a tensor missing", drop_tensor)

    cfg = json.loads((valid / "config.json").read_text())

    def config(**changes):
        def change(d: Path) -> None:
            (d / "config.json").write_text(json.dumps({k: v for k, v in (cfg | changes).items() if v != ...}))
        return change

    for key, value in (("hidden_size", "64"), ("hidden_size", 64.5), ("hidden_size", -64), ("hidden_size", 0),
                       ("hidden_size", True), ("hidden_size", None), ("hidden_size", ...),
                       ("vocab_size", 10**30), ("num_hidden_layers", 10**9), ("max_position_embeddings", 10**12),
                       ("num_key_value_heads", 3), ("rms_norm_eps", "small"),
                       ("rope_theta", float("inf")), ("architectures", "LlamaForCausalLM"),
                       ("rope_scaling", [1]), ("eos_token_id", "</s>"), ("tie_word_embeddings", "yes")):
        add(f"config {key} = {value!r}", config(**{key: value}), field=key)
    for key, value in (("vocab_size", 2**30), ("intermediate_size", 2**40)):  # in range, not in the file
        add(f"config {key} = {value!r}", config(**{key: value}))
    add("config num_attention_heads 6 (hidden 64)", config(num_attention_heads=6, head_dim=None),
        field="num_attention_heads")
    add("config intermediate_size 100, tensors of 128", config(intermediate_size=100), field="tensor")
    add("config num_key_value_heads 4, tensors of 2", config(num_key_value_heads=4), field="tensor")
    for what, text in (("a list", "[1, 2]"), ("cut in half", (valid / "config.json").read_text()[:40]),
                       ("not UTF-8", "\udcff")):
        add(f"config.json {what}",
            lambda d, t=text: (d / "config.json").write_bytes(t.encode("utf-8", "surrogateescape")))
    for tok in ("tokenizer.json", "tokenizer_config.json"):
        text = (valid / tok).read_text()
        add(f"{tok} cut in half", lambda d, t=text, f=tok: (d / f).write_text(t[:len(t) // 2]))
    return variants


def test_damaged_hf_directories_raise_model_file_error(hf_dir, tmp_path):
    variants = _hf_variants(hf_dir, tmp_path)
    assert len(variants) > 60
    _check(hf_dir, variants)


# ---- what a user sees ----------------------------------------------------------------------
def test_cli_names_the_damaged_file_in_one_line(tmp_path, capsys):
    from travelator.cli import main

    valid = _write_gguf(tmp_path / "valid.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(valid.read_bytes()[:5000])
    assert main(["generate", "--model", str(bad), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad}: ") and "truncated" in err[0], err


def test_llm_names_a_tensor_the_config_disagrees_with(tmp_path):
    from travelator import LLM
    from travelator.model.model_file_error import ModelFileError

    path = _write_gguf(tmp_path / "ffn48.gguf", ffn_key=48)
    with pytest.raises(ModelFileError, match="mlp") as e:
        LLM(str(path), kernels="torch")  # plain torch: no kernels to build
    assert e.value.path == str(path)
    assert torch.get_default_dtype() == torch.float32
