"""Native CPU kernels, compiled on first use with torch's C++ extension tooling.

The build is cached per source, torch version and CPU (it is compiled with
``-march=native``, so a cache made on one CPU is never loaded on another). Where no
compiler is available the engine falls back to the pure-torch path, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = ("paged_attention.cpp", "norm.cpp", "activation.cpp", "rope.cpp", "kv_write.cpp", "sampling.cpp",
            "small_m_linear.cpp", "blocked_linear.cpp", "quant_linear.cpp", "quant_dequantize.cpp",
            "quant_w8a8.cpp", "layer_stack.cpp", "moe_experts.cpp")
_HEADERS = ("attention_avx2.h", "attention_avx512.h", "attention_common.h", "attention_portable.h",
            "attention_tiled_bf16.h", "float_math.h", "kv_layout.h", "linear_route.h", "quant_common.h",
            "quant_tiles_avx2.h", "quant_tiles_avx512.h", "row_common.h", "small_m_tiles.h", "streaming_linear.h",
            "vec16.h", "vec8.h")
_CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers (its parallel backend
# here); without the flag it compiles to a serial loop and every kernel runs on one thread.
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


class NativeKernelsUnavailable(RuntimeError):
    pass


def _cpu_signature() -> str:
    """The CPU's model and feature flags: what -march=native compiles for."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    return model + flags


def _build_key() -> str:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def load() -> None:
    """Compile (or load the cached build of) the kernels; registers torch.ops.travelator.

    Raises NativeKernelsUnavailable when they cannot be built here.
    """
    from torch.utils import cpp_extension

    key = _build_key()
    root = Path(os.environ.get("TRAVELATOR_KERNEL_CACHE", Path.home() / ".cache" / "travelator" / "kernels"))
    build_dir = root / key
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=f"travelator_kernels_{key}",
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, headers or ninja: the caller falls back
        raise NativeKernelsUnavailable(f"native kernels could not be built: {exc}") from exc


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernels build here; a failure is reported (and tried) once per process."""
    try:
        load()
    except NativeKernelsUnavailable as exc:
        log.warning("%s; running on plain torch (kernels=torch)", exc)
        return False
    return True
