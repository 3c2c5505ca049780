"""benchmarks/gpu_check.py, the device check, in its cheapest pieces: the table and its
verdicts, the section guard and the time budget, workload W's recipe, the extrapolation of
transformers' time, and one section run on the CPU at the smoke run's tiny shapes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from paths import load_script

REPO = Path(__file__).resolve().parents[2]
PEERS_W = REPO.parent / "shared" / "peers" / "workload_w.py"


gc = load_script("gpu_check", REPO / "benchmarks" / "gpu_check.py")


def test_workload_w_is_the_documented_recipe():
    work = gc.workload_w(0, 64)
    assert sum(n for _, n in work) == 8435  # what ../shared/peers/workload_w.py asserts
    assert all(16 <= len(p) <= 256 and 8 <= n <= 256 for p, n in work)
    assert all(100 <= t <= 30000 for p, _ in work for t in p)
    assert gc.workload_w(0, 512)[:64] == work  # scaled up: the same first requests
    if PEERS_W.is_file():
        assert work == load_script("peers_workload_w", PEERS_W).workload_w(0, 64)


def test_verdicts_and_table():
    check = gc.Check(gc.SMOKE_PLAN)
    gc.target_row(check, "batch-1", 1.25, "<=", 1.3, "step 5 ms")
    gc.target_row(check, "W", 9.5, ">=", 10, "slow")
    check.add("copy bandwidth", "3.1 TB/s")
    assert [r.verdict for r in check.rows] == ["pass", "FAIL", ""]
    assert check.rows[0].measured == "1.25x: step 5 ms" and check.rows[1].target == ">= 10x"
    lines = gc.format_table(check.rows).splitlines()
    assert lines[0].split() == ["check", "measured", "target", "result"]
    assert set(lines[1]) == {"-"} and len(lines) == 5
    assert lines[2].endswith("<= 1.3x  pass") and lines[3].endswith(">= 10x   FAIL")
    assert lines[2].index("1.25x") == lines[4].index("3.1 TB/s")  # columns line up
    assert gc.exit_status(check.rows, smoke=False) == 1
    assert gc.exit_status(check.rows, smoke=True) == 0  # tiny CPU shapes miss targets


def test_a_failing_or_late_section_leaves_its_row_and_the_run_goes_on():
    check = gc.Check(gc.SMOKE_PLAN)
    ran = []

    def boom(c):
        raise RuntimeError("out of\n memory")

    gc.guarded(check, "first", 0, boom)
    gc.guarded(check, "second", 0, lambda c: ran.append(c))
    check.start = time.monotonic() - check.plan.budget + 5  # five seconds left
    gc.guarded(check, "third", 30, lambda c: ran.append(c))
    assert len(ran) == 1
    first, third = check.rows
    assert (first.check, first.verdict, first.measured) == ("first", "error",
                                                            "RuntimeError: out of memory")
    assert third.verdict == "skipped" and "needs about 30 s" in third.measured
    assert gc.exit_status(check.rows, smoke=True) == 1


def test_transformers_time_is_extrapolated_by_decode_steps():
    assert gc.extrapolated([10.0, 10.0], [200, 200, 100, 100]) == pytest.approx(30.0)
    assert gc.extrapolated([4.0], [100]) == 4.0  # every batch ran: no extrapolation


def test_batch1_section_on_the_cpu():
    check = gc.Check(gc.replace(gc.SMOKE_PLAN, batch1_steps=2))
    gc.copy_bandwidth(check)
    gc.load_engine(check)
    gc.batch1(check)
    embed = check.llm.engine.runner.model.embed
    assert embed.float().std().item() == pytest.approx(0.02, rel=0.1)  # drawn, not left empty
    _, start, row = check.rows
    assert start.check == "engine start-up: dummy:tiny" and "bfloat16, cpu" in start.measured
    assert row.target == "<= 1.3x" and row.verdict in ("pass", "FAIL")
    assert float(row.measured.split("x:")[0]) > 0
