"""A checkout without shared/ beside it skips the tests that need the model, except under CI's
TRAVELATOR_REQUIRE_SHARED=1, where the run fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
NEEDS_MODEL = "from paths import needs_stories\n\npytestmark = needs_stories\n\n\ndef test_x():\n    pass\n"


def _run_alone(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    tests = tmp_path / "repo" / "tests"  # ../shared does not exist from here
    tests.mkdir(parents=True)
    for name in ("conftest.py", "paths.py"):
        shutil.copy(HERE / name, tests)
    (tests / "test_needs_model.py").write_text(NEEDS_MODEL)
    env = {k: v for k, v in os.environ.items() if k != "TRAVELATOR_REQUIRE_SHARED"}
    if require is not None:
        env["TRAVELATOR_REQUIRE_SHARED"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=tests.parent, env=env, capture_output=True, text=True, timeout=120)


def test_missing_model_skips_with_a_reason(tmp_path: Path) -> None:
    proc = _run_alone(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout


def test_missing_model_fails_the_run_when_required(tmp_path: Path) -> None:
    proc = _run_alone(tmp_path, "1")
    assert proc.returncode != 0
    assert "TRAVELATOR_REQUIRE_SHARED=1 but" in proc.stdout + proc.stderr
