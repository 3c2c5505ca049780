"""The native kernels compile for each kind of CPU the project serves, not only this machine's.

They are built with -march=native, so a build here compiles only this CPU's branches of their
#if guards; a branch of another CPU's (an AMX call left outside its guard, say) would break the
build there, and the engine would fall back to plain torch. Each source is compiled here (-O0,
no output: the inliner runs, so an intrinsic outside its target's guard fails too) for: AVX2
only (Zen 3), AVX2 with AVX-VNNI (Intel client cores), AVX-512 without BF16 (Cascade Lake),
AVX512-BF16 without AMX (Zen 4/5: gcc 12's cooperlake has the same instruction sets for these
kernels), and AMX (Sapphire Rapids).
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from paths import REQUIRE_NATIVE
from torch.utils import cpp_extension

from travelator import kernels

CSRC = Path(kernels.__file__).parent / "csrc"
CPU_KINDS = {"avx2": "znver3", "avx2-avx-vnni": "alderlake", "avx512": "cascadelake",
             "avx512-bf16-without-amx": "cooperlake", "amx": "sapphirerapids"}


def compile_errors(source: Path, march: str) -> str:
    """The compiler's errors for one source on one target ("" where it compiles)."""
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    flags = [f for f in kernels._CFLAGS if not f.startswith(("-march", "-O"))]
    cmd = ["g++", "-std=c++20", "-O0", "-c", "-o", "/dev/null", f"-march={march}", *flags, *includes, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return (done.stderr or f"exit status {done.returncode}") if done.returncode else ""


def needs_gxx() -> None:
    if shutil.which("g++") is None:
        if REQUIRE_NATIVE:
            pytest.fail("TRAVELATOR_REQUIRE_NATIVE=1 but there is no g++")
        pytest.skip("no g++")


@pytest.mark.parametrize("kind", sorted(CPU_KINDS))
def test_every_kernel_source_compiles_for(kind):
    needs_gxx()
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = pool.map(lambda s: compile_errors(CSRC / s, CPU_KINDS[kind]), kernels._SOURCES)
    failed = {source: text[:2000] for source, text in zip(kernels._SOURCES, errors) if text}
    assert failed == {}, f"-march={CPU_KINDS[kind]}:\n" + "\n".join(failed.values())


def test_an_intrinsic_outside_its_guard_is_caught(tmp_path):
    """The check itself fails where it should: an AVX-512 intrinsic in a Zen 3 build."""
    needs_gxx()
    source = tmp_path / "unguarded.cpp"
    source.write_text("#include <immintrin.h>\n"
                      "__m512 twice(__m512 v) { return _mm512_add_ps(v, v); }\n")
    assert "target specific option mismatch" in compile_errors(source, "znver3")
    assert compile_errors(source, "cascadelake") == ""
