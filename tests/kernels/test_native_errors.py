"""A failed TORCH_CHECK in a native op reaches Python as a RuntimeError, for every op.

The cases (native_bad_inputs.py) run in a subprocess: a check that fires where C++ cannot
carry the exception out (an OpenMP region of its own, outside at::parallel_for) aborts the
process, and a missing check can end it with SIGSEGV or SIGFPE; either fails this test and
names the call, instead of killing pytest. See docs/design.md on the native kernels' errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from travelator import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels do not build here")
SCRIPT = Path(__file__).with_name("native_bad_inputs.py")
REPO = Path(__file__).resolve().parents[2]


def run_cases(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600)


def describe(proc: subprocess.CompletedProcess) -> str:
    status = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
              else f"exit status {proc.returncode}")
    return f"{status}\n--- stdout\n{proc.stdout}\n--- stderr (end)\n{proc.stderr[-3000:]}"


def test_every_native_op_raises_runtime_error_on_bad_input():
    import native_bad_inputs

    proc = run_cases()
    assert proc.returncode == 0, describe(proc)
    raised = {ln.split()[1].rstrip(":") for ln in proc.stdout.splitlines() if ln.startswith("raised ")}
    assert raised == native_bad_inputs.registered() - native_bad_inputs.NO_INPUTS, describe(proc)
    assert {"paged_attention", "rope_", "write_kv_", "rms_norm", "decoder_layers"} <= raised


def test_a_crash_in_the_subprocess_fails_with_the_call_named(tmp_path):
    """The harness itself: a case that kills its process is reported with the signal and the
    call, as a check escaping an OpenMP region would be (SIGABRT from std::terminate)."""
    stub = tmp_path / "crash.py"
    stub.write_text("import os, signal\nprint('calling rope_', flush=True)\nos.kill(os.getpid(), signal.SIGABRT)\n")
    proc = subprocess.run([sys.executable, str(stub)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGABRT
    assert "killed by SIGABRT" in describe(proc) and "calling rope_" in describe(proc)
