"""Native CPU kernels, compiled on first use with torch's C++ extension tooling.

The build is cached per source, torch installation and CPU (it is compiled with
``-march=native``, so a cache made on one CPU is never loaded on another; two virtualenvs or
two checkouts get two entries, as their build files name their own headers and sources). Where no compiler is available the
engine falls back to the pure-torch path, with a warning.

One process builds an entry at a time, under an ``fcntl`` lock that the kernel releases when
its holder dies; torch's own lock file, which a killed builder leaves behind (and which would
make every later build wait for ever), is removed by whoever holds that lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The files compiled, one compiler run each: two of them include several sources, so that
# torch's headers (most of a small source's compile time) are parsed three times, not once a
# source, and the attention kernel's templates compile beside them on a second core.
_UNITS = ("paged_attention.cpp", "unit_rows.cpp", "unit_linear.cpp")
_SOURCES = ("paged_attention.cpp", "norm.cpp", "activation.cpp", "rope.cpp", "kv_write.cpp", "sampling.cpp",
            "small_m_linear.cpp", "blocked_linear.cpp", "quant_linear.cpp", "quant_dequantize.cpp",
            "quant_w8a8.cpp", "layer_stack.cpp", "moe_experts.cpp", "panel_linear.cpp")
_HEADERS = ("amx_tiles.h", "attention_avx2.h", "attention_avx512.h", "attention_common.h", "attention_flash.h",
            "attention_portable.h", "attention_tiled_bf16.h", "attention_tiles_amx.h", "dynamic_split.h",
            "float_math.h", "kv_layout.h", "linear_route.h", "quant_common.h", "quant_tiles_avx2.h",
            "quant_tiles_avx512.h", "row_common.h", "small_m_tiles.h", "streaming_linear.h", "vec16.h", "vec8.h")
_CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers (its parallel backend
# here); without the flag it compiles to a serial loop and every kernel runs on one thread.
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
# Another CPU kind's target (znver3: AVX2 only, say) instead of this CPU's, so that its kernel
# paths run, and their tests with them, on a CPU that has their instructions.
_MARCH_VARIABLE = "TRAVELATOR_KERNEL_MARCH"


def _march() -> str:
    return os.environ.get(_MARCH_VARIABLE) or "native"


def _cflags() -> tuple[str, ...]:
    return tuple(f"-march={_march()}" if f == "-march=native" else f for f in _CFLAGS)


class NativeKernelsUnavailable(RuntimeError):
    pass


def _cpuinfo_field(name: str) -> str:
    """A field of /proc/cpuinfo's first processor ("" where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in info.splitlines() if ln.startswith(name)), "")
    return line.partition(":")[2].strip()


def _cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor()


def _cpu_signature() -> str:
    """The CPU's model and feature flags: what -march=native compiles for."""
    return _cpu_name() + " " + _cpuinfo_field("flags")


def _build_key() -> str:
    from torch.utils import cpp_extension

    h = hashlib.sha256()
    for name in dict.fromkeys(_UNITS + _SOURCES + _HEADERS):
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(_cflags() + _LDFLAGS).encode())
    h.update(torch.__version__.encode())
    # What the generated build file names: the sources' own path (two checkouts of the same
    # sources would otherwise rebuild each other's entry), this torch's headers and this Python's.
    h.update(" ".join([str(_CSRC)] + cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]).encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    return Path(os.environ.get("TRAVELATOR_KERNEL_CACHE", Path.home() / ".cache" / "travelator" / "kernels"))


@contextlib.contextmanager
def _building(build_dir: Path) -> Iterator[None]:
    """Hold the entry's build lock (waiting, said once, while another process builds it); with
    it held, no live process is building here, so torch's lock file is a dead builder's."""
    with open(build_dir / "travelator.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"travelator: waiting for another process building the native kernels in {build_dir}",
                  file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)
def load() -> None:
    """Compile (or load the cached build of) the kernels; registers torch.ops.travelator.

    Raises NativeKernelsUnavailable when they cannot be built here.
    """
    from torch.utils import cpp_extension

    key = _build_key()
    name = f"travelator_kernels_{key}"
    build_dir = _cache_root() / key
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _building(build_dir):
            if not (build_dir / f"{name}.so").exists():
                target = "" if _march() == "native" else f" as -march={_march()} (${_MARCH_VARIABLE})"
                print(f"travelator: building the native kernels for this CPU ({_cpu_name()}){target}: about a "
                      f"minute, once (cached in {build_dir})", file=sys.stderr, flush=True)
            cpp_extension.load(
                name=name,
                sources=[str(_CSRC / unit) for unit in _UNITS],
                extra_cflags=list(_cflags()),
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, headers or ninja, an unwritable cache: the caller falls back
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
