"""The native kernels compile for each kind of CPU the project serves, not only this machine's.

They are built with -march=native, so a build here compiles only this CPU's branches of their
#if guards; a branch of another CPU's (an AMX call left outside its guard, say) would break the
build there, and the engine would fall back to plain torch. Each source is checked here with
-fsyntax-only for three targets: AVX2 only (Zen 3), AVX512-BF16 without AMX (Zen 4/5: gcc 12's
cooperlake has the same instruction sets for these kernels), and AMX (Sapphire Rapids).
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
CPU_KINDS = {"avx2": "znver3", "avx512-bf16-without-amx": "cooperlake", "amx": "sapphirerapids"}


def syntax_errors(source: str, march: str) -> str:
    """The compiler's errors for one source on one target ("" where it compiles)."""
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    flags = [f for f in kernels._CFLAGS if not f.startswith("-march")]
    cmd = ["g++", "-std=c++20", "-fsyntax-only", f"-march={march}", *flags, *includes, str(CSRC / source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.stderr if done.returncode else ""


@pytest.mark.parametrize("kind", sorted(CPU_KINDS))
def test_every_kernel_source_compiles_for(kind):
    if shutil.which("g++") is None:
        if REQUIRE_NATIVE:
            pytest.fail("TRAVELATOR_REQUIRE_NATIVE=1 but there is no g++")
        pytest.skip("no g++")
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = dict(zip(kernels._SOURCES, pool.map(lambda s: syntax_errors(s, CPU_KINDS[kind]), kernels._SOURCES)))
    failed = {source: text[:2000] for source, text in errors.items() if text}
    assert failed == {}, f"-march={CPU_KINDS[kind]}"
