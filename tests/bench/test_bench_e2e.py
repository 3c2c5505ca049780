"""End-to-end runs of ``bench throughput``, ``bench compare`` and ``bench serve``, tiny.

stories260K, a handful of requests, a few tokens each: these check that the commands
run and write their reports, never how fast anything is.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from live import serve_in_thread
from paths import STORIES, needs_stories

from travelator.bench.cli import main

pytestmark = needs_stories

TINY = ["--model", str(STORIES), "--max-num-seqs", "4", "--max-model-len", "64",
        "--prompt-len-range", "4", "12", "--output-len-range", "1", "6", "--no-progress"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_compare_writes_json_and_pngs(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", *TINY, "--num-requests", "5", "--request-rates", "50", "inf",
               "--output-dir", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    last = printed.strip().splitlines()[-1]
    assert last.startswith("Throughput ratio at median normalised latency")
    report = json.loads((out / "compare.json").read_text())
    assert {(r["scheduler"], r["rate"]) for r in report["results"]} == {
        ("static", 50.0), ("iteration", 50.0), ("static", "inf"), ("iteration", "inf")}
    assert all(r["completed"] == 5 and r["failed"] == 0 for r in report["results"])
    assert report["ratio_lines"] == [last]
    trace = report["occupancy_trace"]
    assert trace["max_num_seqs"] == 4
    for sched in ("static", "iteration"):
        busy = trace["steps"][sched]["num_requests"]
        assert busy and max(busy) <= 4
    for name in ("latency_vs_throughput.png", "batch_occupancy.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    # walkway.html replays the occupancy rate's runs (inf, the highest): one record per step
    # the runner counted, each request joining once.
    replay = replay_data((out / "walkway.html").read_text())
    assert [p["name"] for p in replay["panels"]] == ["static", "iteration"]
    for panel in replay["panels"]:
        records = panel["records"]
        assert len(records) == len(trace["steps"][panel["name"]]["num_requests"])
        assert [r["seats"] and len(r["seats"]) for r in records] == trace["steps"][panel["name"]]["num_requests"]
        joined = [rid for r in records for rid in r["joined"]]
        assert len(joined) == len(set(joined)) == 5 and panel["info"]["max_num_seqs"] == 4


def replay_data(page: str) -> dict:
    start = page.index("window.TRAVELATOR_REPLAY = ") + len("window.TRAVELATOR_REPLAY = ")
    return json.loads(page[start:page.index(";\n", start)])


def test_bench_compare_every_batching_mode(tmp_path, capsys):
    out = tmp_path / "hist"
    rc = main(["compare", *TINY, "--num-requests", "5", "--request-rates", "inf",
               "--batching", "chunked", "orca", "dynamic", "static", "--max-queue-delay-ms", "20",
               "--output-dir", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads((out / "compare.json").read_text())
    assert report["modes"] == ["static", "dynamic", "orca", "iteration"]
    assert [r["scheduler"] for r in report["results"]] == report["modes"]
    assert all(r["completed"] == 5 and r["failed"] == 0 for r in report["results"])
    # One ratio line per baseline, chunked (iteration) against each, last.
    assert lines[-3:] == report["ratio_lines"]
    assert [(r["subject"], r["baseline"]) for r in report["ratios"]] == [
        ("iteration", "static"), ("iteration", "dynamic"), ("iteration", "orca")]
    assert report["engine"]["max_queue_delay_ms"] == 20


def test_bench_throughput_writes_json(tmp_path, capsys):
    path = tmp_path / "tp.json"
    rc = main(["throughput", *TINY, "--num-requests", "4", "--workload", "orca",
               "--goodput", "ttft:60000", "--output-json", str(path), "--profile"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Request throughput (req/s):" in printed and "=== profile ===" in printed
    report = json.loads(path.read_text())
    m = report["metrics"]
    assert m["completed"] == 4 and m["good_requests"] == 4
    assert m["total_output_tokens"] == report["workload"]["total_output_tokens"]
    assert report["steps"]["num_steps"] > 0


# ---- bench serve against a stand-in server ------------------------------------------------
def _fake_openai_server():
    """A minimal streaming /v1/completions: one SSE chunk per token, then usage and [DONE]."""
    app = FastAPI()
    seen: list[dict] = []

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        seen.append(body)
        n = body["max_tokens"]

        async def events():
            for i in range(n):
                await asyncio.sleep(0.002)
                fin = "length" if i == n - 1 else None
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": fin}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


@pytest.fixture()
def fake_server():
    app, seen = _fake_openai_server()
    with serve_in_thread(app, name="fake-openai", log_level="error") as url:
        yield url, seen


def test_bench_serve_client_against_a_stand_in_server(fake_server, tmp_path):
    url, seen = fake_server
    path = tmp_path / "serve.json"
    rc = main(["serve", "--base-url", url, "--vocab-size", "512", "--num-requests", "6",
               "--workload", "fixed", "--prompt-len", "5", "--output-len", "4",
               "--request-rate", "200", "inf", "--max-concurrency", "3",
               "--goodput", "ttft:10000", "--no-progress", "--output-json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert [r["rate"] for r in report["runs"]] == [200.0, "inf"]
    for run in report["runs"]:
        m = run["metrics"]
        assert m["completed"] == 6 and m["failed"] == 0
        assert m["total_output_tokens"] == 24 and m["good_requests"] == 6
        assert m["median_ttft_ms"] > 0 and m["median_itl_ms"] > 0
        assert all(r["num_events"] == 4 for r in run["requests"])
    body = seen[-1]
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["ignore_eos"] is True and len(body["prompt"]) == 5


def test_bench_serve_starts_a_real_server(tmp_path, capsys):
    path = tmp_path / "serve.json"
    rc = main(["serve", *TINY, "--num-requests", "4", "--request-rate", "inf",
               "--output-json", str(path), "--server-timeout", "120"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(path.read_text())
    assert report["started_server"]
    m = report["runs"][0]["metrics"]
    assert m["completed"] == 4
    assert m["total_output_tokens"] == report["workload"]["total_output_tokens"]


def test_bench_interference_reports_every_mode(tmp_path, capsys):
    out = tmp_path / "intf"
    rc = main(["interference", "--model", str(STORIES), "--max-num-seqs", "8", "--max-model-len", "256",
               "--max-num-batched-tokens", "32", "--num-decodes", "3", "--decode-output-len", "24",
               "--num-long", "2", "--long-prompt-len", "100", "--first-long-at", "0.01",
               "--long-every", "0.01", "--max-queue-delay-ms", "10", "--output-dir", str(out),
               "--repeats", "2", "--no-progress"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("p99 time between tokens of the running decodes: chunked prefill")
    report = json.loads((out / "interference.json").read_text())
    assert report["modes"] == ["static", "dynamic", "orca", "iteration"] and report["ratio_line"] == last
    assert set(report["summary"]) == set(report["modes"]) and len(report["results"]) == 8
    by_mode = {r["mode"]: r for r in report["results"]}
    assert all(r["failed"] == 0 for r in by_mode.values())
    # Whole prompts: a 100-token prompt in one step over the budget of 32; chunks never exceed it.
    assert by_mode["orca"]["max_step_tokens"] >= 100
    assert by_mode["iteration"]["max_step_tokens"] <= 32 and by_mode["static"]["max_step_tokens"] <= 32
    # Every steady decode's gaps are there: 3 decodes x 23 gaps.
    assert all(len(report["traces"][m]["tbt_ms"]) == 3 * 23 for m in report["modes"])
    for name in ("tbt_cdf.png", "step_timeline.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_bench_interference_runs_the_disaggregated_fifth_mode(tmp_path, capsys):
    import multiprocessing

    out = tmp_path / "intf"
    rc = main(["interference", "--model", str(STORIES), "--max-num-seqs", "8", "--max-model-len", "256",
               "--num-kv-blocks", "64", "--max-num-batched-tokens", "32", "--num-decodes", "3",
               "--decode-output-len", "24", "--num-long", "2", "--long-prompt-len", "100",
               "--first-long-at", "0.01", "--long-every", "0.01", "--batching", "orca", "iteration",
               "--disaggregate", "1:1", "--output-dir", str(out), "--no-progress"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("disaggregated vs chunked prefill: p99 TBT")
    report = json.loads((out / "interference.json").read_text())
    assert report["modes"] == ["orca", "iteration", "disaggregated"]
    row = {r["mode"]: r for r in report["results"]}["disaggregated"]
    assert row["failed"] == 0
    # Every request with more than one output token handed its KV over (3 decodes, 2 long prompts).
    assert row["kv_transfer_mb"] > 0 and row["kv_transfer_ms"] > 0
    assert len(report["traces"]["disaggregated"]["tbt_ms"]) == 3 * 23
    assert not multiprocessing.active_children()  # the workers were stopped
