"""``travelator simulate`` from the command line: a sweep over modes, a fitted cost model from a
file, a trace, and the planning answer."""

from __future__ import annotations

import json

import pytest

from travelator.cli import main
from travelator.sim.cost_model import LinearCostModel


def test_a_sweep_over_modes_prints_the_compare_table_and_ratio(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--model", "dummy:tiny", "--hardware", "zen3-avx2-2core", "--num-requests", "60",
               "--batching", "static", "iteration", "--request-rate", "2", "8", "--output-json", str(out),
               "--output-dir", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "simulated static @ 8 req/s" in text and "Throughput ratio" in text
    report = json.loads(out.read_text())
    assert [(r["rate"], r["scheduler"]) for r in report["results"]] == [
        (2, "static"), (2, "iteration"), (8, "static"), (8, "iteration")]
    assert all(r["completed"] == 60 for r in report["results"])
    assert (tmp_path / "latency_vs_throughput.png").stat().st_size > 0


def test_a_fitted_model_and_a_trace(tmp_path, capsys):
    cost = tmp_path / "cost.json"
    LinearCostModel({"intercept": 0.01}).save(cost)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,16,3\n0.5,16,3\n")
    rc = main(["simulate", "--model", "dummy:tiny", "--cost-model", str(cost), "--trace", str(trace),
               "--goodput", "ttft:15", "--output-json", str(tmp_path / "r.json")])
    assert rc == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    # Each request alone: its prompt's step (10 ms) to the first token, two decodes after.
    assert row["median_ttft_ms"] == pytest.approx(10.0) and row["median_e2el_ms"] == pytest.approx(30.0)
    assert row["good_requests"] == 2


def test_find_max_rate_and_its_errors(tmp_path, capsys):
    args = ["simulate", "--model", "dummy:tiny", "--hardware", "zen3-avx2-2core", "--num-requests", "100"]
    assert main(args + ["--find-max-rate", "--slo", "ttft_p99=500ms"]) == 0
    assert "highest rate meeting ttft_p99=500ms" in capsys.readouterr().out
    assert main(args + ["--find-max-rate"]) == 2
    assert "--find-max-rate needs --slo" in capsys.readouterr().err
    assert main(args + ["--find-max-rate", "--slo", "ttft=1s"]) == 2
    assert "bad SLO 'ttft=1s'" in capsys.readouterr().err
    assert main(["simulate", "--model", "dummy:tiny"]) == 2
    assert "give one cost model" in capsys.readouterr().err


def test_the_disaggregated_mode_beside_chunked_batching(tmp_path, capsys):
    args = ["simulate", "--model", "dummy:tiny", "--hardware", "zen3-avx2-2core", "--num-requests", "40",
            "--batching", "iteration", "disaggregated", "--request-rate", "4", "--output-json", str(tmp_path / "r.json")]
    assert main(args) == 2  # this CPU description has no link between pools
    assert "give --handoff-gbps" in capsys.readouterr().err
    assert main(args + ["--handoff-gbps", "10"]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["scheduler"] for r in rows] == ["iteration", "disaggregated"]
    assert all(r["completed"] == 40 for r in rows)


def test_find_max_rate_over_batch_sizes_picks_the_best(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["simulate", "--model", "dummy:tiny", "--hardware", "zen3-avx2-2core", "--num-requests", "40",
            "--find-max-rate", "--slo", "ttft_p99=500ms", "--output-json", str(out)]
    assert main(args + ["--max-num-seqs-choices", "1", "16"]) == 0
    searches = json.loads(out.read_text())["searches"]
    assert [s["max_num_seqs"] for s in searches] == [1, 16]
    one, sixteen = (s["max_rate"] for s in searches)
    assert one < sixteen  # one seat serializes the requests
    assert f"{sixteen:.4g} req/s with max_num_seqs 16" in capsys.readouterr().out


def test_fit_step_cost_writes_a_model_the_simulator_loads(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["fit-step-cost", "--model", "dummy:tiny", "--output", str(out), "--profile-seconds", "2"]) == 0
    model = LinearCostModel.load(out)
    assert model.info["model"] == "dummy:tiny" and len(model.info["profile"]) == model.info["profiled_steps"]
    assert len(model.info["load_avg_start_end"]) == 2
    assert "held-out steps: median error" in capsys.readouterr().out
    assert main(["simulate", "--model", "dummy:tiny", "--cost-model", str(out), "--num-requests", "20",
                 "--request-rate", "4"]) == 0
