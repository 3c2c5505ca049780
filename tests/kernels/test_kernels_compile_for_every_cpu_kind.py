"""The native kernels compile for each kind of CPU the project serves, not only this machine's.

They are built with -march=native, so a build here compiles only this CPU's branches of their
#if guards; a branch of another CPU's (an AMX call left outside its guard, say) would break the
build there, and the engine would fall back to plain torch. Each source is compiled here (-O0,
no output: the inliner runs, so an intrinsic outside its target's guard fails too) for: AVX2
only (Zen 3), AVX2 with AVX-VNNI (Intel client cores), AVX-512 without BF16 (Cascade Lake),
AVX512-BF16 without AMX (Zen 4/5: gcc 12's cooperlake has the same instruction sets for these
kernels), and AMX (Sapphire Rapids).

The build's units (the files it compiles, two of which include several sources) are compiled
together, as one file that includes them all, so torch's headers are parsed once a target
rather than once a unit; where that file does not compile, each unit is compiled alone, as the
build compiles it, so that a name two units share cannot fail the check (two sources of one
unit that share a name break the build, and fail it). The price: a branch for another CPU
that leans on an include or a declaration an earlier unit brought in passes here, though its
unit alone would not compile there (a native build on that CPU, as CI's
TRAVELATOR_REQUIRE_NATIVE=1 demands, would fail); compiling each unit alone for every target
would take about twice as long.

Under TRAVELATOR_REQUIRE_NATIVE=1 (CI) the kind whose branches this machine's own build takes
(the instruction-set macros the sources test are defined alike under -march=native and its
-march) is left to that build, which must succeed there: compiling it again here would check
the same branches.
"""

from __future__ import annotations

import re
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
    """The compiler's errors for one file on one target ("" where it compiles)."""
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    flags = [f for f in kernels._CFLAGS if not f.startswith(("-march", "-O"))]
    cmd = ["g++", "-std=c++20", "-O0", "-c", "-o", "/dev/null", f"-march={march}", *flags, *includes, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return (done.stderr or f"exit status {done.returncode}") if done.returncode else ""


def sources_errors(sources: list[Path], march: str, workdir: Path) -> dict[str, str]:
    """Each failing file's errors on one target: all of them in one file first, then, only
    where that fails, one by one (two workers)."""
    together = workdir / f"all-{march}.cpp"
    together.write_text("".join(f'#include "{source}"\n' for source in sources))
    if not compile_errors(together, march):
        return {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = pool.map(lambda source: compile_errors(source, march), sources)
    return {source.name: text[:2000] for source, text in zip(sources, errors) if text}


def defined_macros(march: str) -> set[str]:
    """The macros g++ predefines for -march=`march`."""
    done = subprocess.run(["g++", "-std=c++20", f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
                          capture_output=True, text=True, check=True)
    return {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}


def guard_macros() -> set[str]:
    """The predefined macros the sources' #if and #elif lines test (__AVX2__, __AMX_TILE__, ...)."""
    guards = re.compile(r"^\s*#\s*(?:if|elif)\b.*$", re.M)
    return {macro for path in CSRC.iterdir() if path.suffix in (".cpp", ".h")
            for guard in guards.findall(path.read_text()) for macro in re.findall(r"__[A-Z0-9_]+__", guard)}


def native_kind() -> str | None:
    """The kind whose branches a -march=native build compiles: the one that defines the same
    tested macros (None where none does)."""
    tested = guard_macros()
    native = defined_macros("native") & tested
    return next((kind for kind, march in CPU_KINDS.items() if defined_macros(march) & tested == native), None)


def needs_gxx() -> None:
    if shutil.which("g++") is None:
        if REQUIRE_NATIVE:
            pytest.fail("TRAVELATOR_REQUIRE_NATIVE=1 but there is no g++")
        pytest.skip("no g++")


@pytest.fixture(scope="module")
def errors_by_kind(tmp_path_factory) -> dict[str, dict[str, str]]:
    """sources_errors for every kind, two kinds at a time (each compile takes one core)."""
    needs_gxx()
    workdir = tmp_path_factory.mktemp("every_cpu_kind")
    units = [CSRC / unit for unit in kernels._UNITS]
    kinds = [kind for kind in CPU_KINDS if not (REQUIRE_NATIVE and kind == native_kind())]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(kinds, pool.map(lambda kind: sources_errors(units, CPU_KINDS[kind], workdir), kinds)))


@pytest.mark.parametrize("kind", sorted(CPU_KINDS))
def test_every_kernel_source_compiles_for(kind, errors_by_kind):
    if kind not in errors_by_kind:
        pytest.skip("this machine's own build (-march=native, required to succeed here) compiles the same branches")
    failed = errors_by_kind[kind]
    assert failed == {}, f"-march={CPU_KINDS[kind]}:\n" + "\n".join(failed.values())


def test_an_intrinsic_outside_its_guard_is_caught(tmp_path):
    """The check itself fails where it should: AVX-512 intrinsics in a Zen 3 build, each named
    by its file though it sits beside a clean one: a function (the inliner refuses it) and a
    macro over a builtin (code generation refuses it)."""
    needs_gxx()
    files = {name: tmp_path / f"{name}.cpp" for name in ("clean", "call", "macro")}
    files["clean"].write_text("int twice(int v) { return v + v; }\n")
    files["call"].write_text("#include <immintrin.h>\n"
                             "__m512 twice(__m512 v) { return _mm512_add_ps(v, v); }\n")
    files["macro"].write_text("#include <immintrin.h>\n"
                              "__mmask16 below(__m512 v) { return _mm512_cmp_ps_mask(v, v, _CMP_LT_OQ); }\n")
    failed = sources_errors(list(files.values()), "znver3", tmp_path)
    assert list(failed) == ["call.cpp", "macro.cpp"]
    assert "target specific option mismatch" in failed["call.cpp"]
    assert "needs isa option" in failed["macro.cpp"]
    assert sources_errors(list(files.values()), "cascadelake", tmp_path) == {}


def test_a_name_two_units_share_does_not_fail_the_check(tmp_path):
    """Units that compile alone pass, though together they would define a name twice."""
    needs_gxx()
    for name in ("one.cpp", "two.cpp"):
        (tmp_path / name).write_text("namespace { int twice(int v) { return v + v; } }\n"
                                     f"int {name[:3]}(int v) {{ return twice(v); }}\n")
    sources = [tmp_path / "one.cpp", tmp_path / "two.cpp"]
    assert sources_errors(sources, "znver3", tmp_path) == {}
    assert "redefinition" in compile_errors(tmp_path / "all-znver3.cpp", "znver3")  # the file both are in


def test_each_kind_takes_branches_of_its_own():
    """The guards are found, and no two kinds define the same tested macros: each kind checks
    branches of its own, and native_kind names at most one."""
    needs_gxx()
    tested = guard_macros()
    assert {"__AVX2__", "__AVX512F__", "__AMX_TILE__", "__AVXVNNI__"} <= tested
    taken = [frozenset(defined_macros(march) & tested) for march in CPU_KINDS.values()]
    assert len(set(taken)) == len(CPU_KINDS)
