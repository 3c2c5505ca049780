"""The native kernels' build cache: a builder killed midway leaves torch's lock file behind,
and the next start must still build (or load) and run; the cache key follows what the build
file names (this torch's and this Python's headers)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from travelator import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels do not build here")

# Loads the kernels and runs one of them: rms_norm of ones is ones.
RUN = ("import torch; from travelator import kernels; kernels.load(); "
       "print(float(torch.ops.travelator.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6).sum()))")


def start(cache: Path, code: str) -> subprocess.Popen:
    env = {**os.environ, "TRAVELATOR_KERNEL_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"no result within {timeout} s: {err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    return out, err


def build_outputs(entry: Path) -> dict[str, int]:
    """The entry's objects and library, each with its modification time."""
    return {p.name: p.stat().st_mtime_ns for p in entry.glob("*.[os]*")}


def test_a_dead_builders_lock_file_does_not_stop_the_next_start(tmp_path):
    """The cached build, with torch's lock file left in it as a killed builder leaves it: the
    next start loads the kernels at once instead of waiting on the file for ever."""
    entry = Path(kernels._cache_root()) / kernels._build_key()
    shutil.copytree(entry, tmp_path / entry.name, ignore=shutil.ignore_patterns("lock", "travelator.lock"))
    (tmp_path / entry.name / "lock").touch()
    built = build_outputs(tmp_path / entry.name)
    out, err = finish(start(tmp_path, RUN), timeout=120)
    assert float(out) == pytest.approx(16.0, rel=1e-5)
    assert "building" not in err  # loaded from the cache,
    assert build_outputs(tmp_path / entry.name) == built  # nothing compiled or linked again


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid``'s process group and to each of its descendants' (ninja starts every
    compile in a group of its own), stopped first so that none starts another meanwhile."""
    groups = {os.getpgid(pid)}
    for _ in range(2):
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGSTOP)
        for child in descendants(pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(child))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def test_a_build_killed_midway_leaves_the_next_start_to_build_and_run(tmp_path):
    """A build killed while it compiles: every object but the build unit of rms_norm's source
    already built (the cached build's, as ninja leaves them), so the kill lands in that unit's
    compile (seconds: torch's headers alone take that long to parse) and the next start
    compiles it alone, then links and runs the kernel it holds."""
    entry = Path(kernels._cache_root()) / kernels._build_key()
    shutil.copytree(entry, tmp_path / entry.name,
                    ignore=shutil.ignore_patterns("lock", "travelator.lock", "*.so", "unit_rows.o"))
    first = start(tmp_path, "from travelator import kernels; kernels.load()")
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/lock")):  # torch's lock: the compile is under way
        assert first.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.2)
    time.sleep(3)
    kill_tree(first.pid)
    first.communicate()
    assert list(tmp_path.glob("*/lock")) and not list(tmp_path.glob("*/*.so"))  # killed midway:
    assert not list(tmp_path.glob("*/unit_rows.o"))  # inside the compile of the object left out
    out, err = finish(start(tmp_path, RUN), timeout=540)
    assert float(out) == pytest.approx(16.0, rel=1e-5)
    assert "building the native kernels for this CPU" in err


def test_the_cache_key_follows_the_paths_the_build_names(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    key = kernels._build_key()
    paths = cpp_extension.include_paths()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/another/venv/include"] + paths)
    other_venv = kernels._build_key()
    monkeypatch.undo()
    copy = tmp_path / "csrc"  # the same sources in another checkout
    shutil.copytree(kernels._CSRC, copy)
    monkeypatch.setattr(kernels, "_CSRC", copy)
    assert len({key, other_venv, kernels._build_key()}) == 3
