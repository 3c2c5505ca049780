"""Find a model's shape, weights and tokenizer from what the user points at:
a HF-layout directory (config.json, *.safetensors, tokenizer files), a GGUF file of
an architecture in ``arch.GGUF_ARCHITECTURES`` (llama.cpp's tensor names and metadata keys, as
its convert_hf_to_gguf.py writes them), or ``dummy:<preset>`` (random weights of a
built-in shape).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from travelator.model.arch import GGUF_ARCHITECTURES, ModelArch, preset, unsupported_architecture
from travelator.model.arch_check import check_fits, check_hf_config
from travelator.model.gguf_arch import GGUF_ROUTER, gguf_arch
from travelator.model.gguf_layout import check_gguf_layout
from travelator.model.gguf_metadata import GgufMetadata
from travelator.model.model_file_error import ModelFileError
from travelator.model.quant import BlockQuantized, parse_gguf_blocks
from travelator.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

WeightIterator = Callable[[], Iterator[tuple[str, torch.Tensor]]]

DUMMY_PREFIX = "dummy:"


@dataclass(slots=True)
class ModelSource:
    name: str
    arch: ModelArch
    tokenizer: Tokenizer
    weights: WeightIterator | None  # None: random weights
    checkpoint_dtype: str | None = None  # what the weights are stored in, if known


def open_model(model: str, load_format: str = "auto") -> ModelSource:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if model.startswith(DUMMY_PREFIX):
        arch = preset(model[len(DUMMY_PREFIX):])
        return ModelSource(model, arch, Tokenizer.byte_level(arch.vocab_size), None)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: give a HF-layout directory, a .gguf file, "
            f"or dummy:<preset>"
        )
    if path.is_dir():
        source = _open_hf_dir(path)
    elif path.suffix == ".gguf":
        source = _open_gguf(path)
    else:
        raise ValueError(f"model {model!r} is neither a directory nor a .gguf file")
    if load_format == "dummy":
        source.weights = None
    return source


# ---- Hugging Face layout -----------------------------------------------------------
def _open_hf_dir(path: Path) -> ModelSource:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        cfg = json.loads(config_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(config_file, None, f"is not valid JSON: {e}") from None
    check_hf_config(cfg, config_file)
    arch = _arch_of(config_file, lambda: ModelArch.from_hf_config(cfg))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    for f in files:
        _check_safetensors(f)
    check_fits(arch, sum(f.stat().st_size for f in files), config_file)
    if (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_pretrained_dir(path)
    else:
        # Token-id prompts still work; text is rendered byte-wise.
        logger.warning("%s has no tokenizer.json: using a byte-level tokenizer", path)
        tokenizer = Tokenizer.byte_level(arch.vocab_size)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return ModelSource(str(path), arch, tokenizer, lambda: _iter_safetensors(files), dtype)


def _arch_of(path: Path, read: Callable[[], ModelArch]) -> ModelArch:
    """``read()``'s ModelArch; what it finds wrong (a missing key, sizes that do not fit
    together) as a ModelFileError of the file at ``path``."""
    try:
        return read()
    except ModelFileError:
        raise
    except KeyError as e:
        raise ModelFileError(path, str(e.args[0]), "is missing") from None
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise ModelFileError(path, None, str(e)) from None


def _check_safetensors(f: Path) -> None:
    """Read the file's header (safetensors checks that every tensor's shape and dtype fill its
    byte range, and the ranges the file), no tensor yet."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as st:
            st.keys()
    except (SafetensorError, OSError) as e:
        raise ModelFileError(f, None, f"is not a readable safetensors file: {e}") from None


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelFileError(f, None, f"could not be read: {e}") from None


# ---- GGUF ----------------------------------------------------------------------------
_GGUF_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# A mixture's experts, stacked in one tensor per projection [experts, out, in]: HF's name of
# each expert's piece ({e}: the expert); the router is GGUF_ROUTER.
_GGUF_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
# llama.cpp's names of a layer's tensors -> HF's (without "model.layers.N."), in every family
# but where _GGUF_FAMILY_NAMES says otherwise.
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    GGUF_ROUTER: "mlp.gate",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_FAMILY_NAMES = {
    # Phi-3: the checkpoint's fused tensors, whole (ffn_up holds gate, then up: 2 x n_ff rows).
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: the MLP's input norm, and the sinks (written as a "weight").
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    # Gemma 3's sandwich norms: ffn_norm is the MLP's input norm here, not the one after attention.
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# Model-level tensors read into ModelArch, not loaded as weights (Phi-3's LongRoPE factors).
_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _open_gguf(path: Path) -> ModelSource:
    import gguf

    check_gguf_layout(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # what the layout leaves to the reader: a duplicate key or tensor name
        raise ModelFileError(path, None, f"could not be read as GGUF: {e}") from None
    meta = GgufMetadata(reader, path)
    name = meta.str("general.architecture", None)
    family = GGUF_ARCHITECTURES.get(name)
    if family is None:
        raise ModelFileError(path, "general.architecture", str(unsupported_architecture(name)))
    tensors = {t.name: t for t in reader.tensors}
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except ModelFileError:
        raise
    except Exception as e:  # a vocabulary of the wrong types, the tokenizers library's errors
        raise ModelFileError(path, "tokenizer.ggml", f"the vocabulary cannot be read: {e}") from None
    arch = _arch_of(path, lambda: gguf_arch(family, meta.under(f"{name}."), tensors, tokenizer))
    check_fits(arch, path.stat().st_size, path)
    all_f32 = all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    dtype = "float32" if all_f32 else None
    return ModelSource(str(path), arch, tokenizer, lambda: _file_errors(path, _iter_gguf(reader, arch)), dtype)


def _file_errors(path: Path, weights: Iterator[tuple[str, torch.Tensor | BlockQuantized]]
                 ) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """``weights``, what goes wrong reading them (a tensor of a shape or type its place does not
    take) as a ModelFileError of the file at ``path``."""
    try:
        yield from weights
    except ModelFileError:
        raise
    except (ValueError, TypeError, IndexError) as e:
        raise ModelFileError(path, None, str(e)) from None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """A llama GGUF's Q/K rows rotate adjacent pairs (llama.cpp's converter permutes them);
    put them back in the rotate-halves layout. Qwen2/Qwen3 files keep HF's layout."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF names of the tensors outside the blocks, and their HF names.
_GGUF_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def _gguf_float_name(gguf_name: str, names: dict[str, str]) -> str:
    """The HF name of a GGUF tensor loaded as floats (``names``: block tensor names)."""
    if gguf_name in _GGUF_TOP_LEVEL:
        return _GGUF_TOP_LEVEL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF files with rope_freqs tensors are not supported")
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _iter_gguf(reader, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """The file's tensors under HF names, as float32 tensors; a linear layer's Q8_0, Q6_K,
    Q4_0, Q4_1, Q4_K or MXFP4 tensor as its blocks (``BlockQuantized``), for the model to keep
    quantized or to dequantize (``LlamaModel.load_weights``). Other quantized types are
    dequantized here."""
    import gguf

    permuted = arch.family in ("llama", "mixtral")  # see _unpermute_rope
    names = _GGUF_NAMES | _GGUF_FAMILY_NAMES.get(arch.family, {})
    # llama.cpp's converter writes Gemma's norm weights w as 1 + w (llama.cpp scales by the weight
    # as it is); travelator's Gemma norms scale by 1 + w, as the HF checkpoint's: take the 1 back.
    norm_offset = 1.0 if arch.norm_unit_offset else 0.0

    kinds = gguf.GGMLQuantizationType
    kept = {kinds.Q8_0: "q8_0", kinds.Q6_K: "q6_k", kinds.Q4_0: "q4_0", kinds.Q4_1: "q4_1", kinds.Q4_K: "q4_k",
            kinds.MXFP4: "mxfp4"}
    warned: set[str] = set()
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_FACTORS:
            continue  # in arch.rope_scaling already
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne order is reversed
        parts = t.name.split(".")
        linear = parts[0] == "blk" and len(parts) > 3 and parts[2] in _GGUF_LINEAR and parts[3] == "weight"
        if parts[0] == "blk" and len(parts) > 3 and parts[2] in _GGUF_EXPERTS:  # gpt-oss's biases too
            yield from _gguf_experts_of(t, shape, int(parts[1]), _GGUF_EXPERTS[parts[2]] + "." + parts[3], kept, warned)
            continue
        if linear and t.tensor_type in kept:
            blocks = parse_gguf_blocks(t.data, kept[t.tensor_type], *shape)
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
            if permuted and parts[2] in ("attn_q", "attn_k"):
                heads = arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads
                order = _unpermute_rope(np.arange(shape[0])[:, None], heads)[:, 0]
                blocks = blocks.rows(torch.from_numpy(order.copy()))
            yield name, blocks
            continue
        data = t.data
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            if linear and t.tensor_type.name not in warned:
                warned.add(t.tensor_type.name)
                logger.warning("GGUF %s tensors (like %s) are dequantized at load: only Q8_0, Q6_K, Q4_0, "
                               "Q4_1, Q4_K and MXFP4 stay quantized", t.tensor_type.name, t.name)
            data = gguf.quants.dequantize(data, t.tensor_type)
        arr = np.asarray(data, dtype=np.float32).reshape(shape)
        name = _gguf_float_name(t.name, names)
        if permuted and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            arr = _unpermute_rope(arr, arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads)
        if norm_offset and t.name.endswith("norm.weight"):
            arr = arr - norm_offset
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # copy out of the mmap


def _gguf_experts_of(t, shape: tuple[int, ...], layer: int, name: str, kept: dict,
                     warned: set[str]) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """A stacked expert tensor [experts, out, in] (or its bias [experts, out]), expert by expert
    under HF's names (``name``: with "{e}" for the expert): a kept quantized type as its blocks,
    anything else as float32."""
    import gguf

    if t.tensor_type in kept:
        experts, rows, cols = shape
        blocks = parse_gguf_blocks(np.asarray(t.data).reshape(experts * rows, -1), kept[t.tensor_type],
                                   experts * rows, cols)
        for e in range(experts):
            yield f"model.layers.{layer}.{name.format(e=e)}", blocks.rows(slice(e * rows, (e + 1) * rows))
        return
    data = t.data
    if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        if t.tensor_type.name not in warned:
            warned.add(t.tensor_type.name)
            logger.warning("GGUF %s tensors (like %s) are dequantized at load: only Q8_0, Q6_K, Q4_0, "
                           "Q4_1, Q4_K and MXFP4 stay quantized", t.tensor_type.name, t.name)
        data = gguf.quants.dequantize(data, t.tensor_type)
    arr = np.asarray(data, dtype=np.float32).reshape(shape)
    for e in range(shape[0]):
        yield f"model.layers.{layer}.{name.format(e=e)}", torch.from_numpy(np.array(arr[e]))
