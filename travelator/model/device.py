"""Choosing the device and dtypes."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def building_on(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a model's parameters are created: on an accelerator straight on it, so that the
    host never holds the whole model (each loaded tensor is copied over as it is read); on the
    CPU as before."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_model_name() -> str:
    """The CPU's model name (``lscpu``'s "Model name"), for the figures a benchmark prints."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def resolve_dtype(requested: str, device: torch.device, native_cpu_kernels: bool = True) -> torch.dtype:
    """"auto" takes bfloat16 wherever it is the faster format, whatever the checkpoint holds
    (a float32 checkpoint too, as vLLM's "auto" halves one): on CUDA, and on every CPU the
    native kernels run on. Where the CPU has no bf16 GEMM (AVX2 machines) those kernels still
    store bf16 and compute in float32 (model/native_linear.py), which reads half the bytes of
    float32 weights; only torch's own bf16 matmul, without the native kernels, is slower than
    float32 there."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {requested!r}")
        return _DTYPES[requested]
    if device.type == "cuda" or native_cpu_kernels or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def halved_note(requested: str, checkpoint_dtype: str | None, dtype: torch.dtype) -> str:
    """What the start-up line says when "auto" holds a float32 checkpoint in 16 bits."""
    if requested != "auto" or checkpoint_dtype != "float32" or dtype == torch.float32:
        return ""
    return f"; the checkpoint's float32 weights held in {str(dtype).removeprefix('torch.')} (--dtype float32 keeps them)"


def resolve_kv_dtype(requested: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: "auto" is the model's; "int8" stores 8-bit codes with a scale
    per token and head (model/kv_layout.py)."""
    if requested == "auto":
        return model_dtype
    if requested == "int8":
        return torch.int8
    return resolve_dtype(requested, device)
