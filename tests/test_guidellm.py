"""guidellm (pinned in the test extra) against a live server: the tokenizer written by
``travelator export-tokenizer``, a short synthetic profile at 4 concurrent streams, zero
errors, every request its 16 tokens, one token per streamed chunk, and figures that make
sense."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from live import serve_in_thread
from paths import STORIES, needs_stories
from travelator import LLM
from travelator.cli import main as travelator_main
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

pytest.importorskip("guidellm")
pytestmark = needs_stories

MODEL = "stories"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server and the exported tokenizer for both request formats."""
    tokenizer_dir = tmp_path_factory.mktemp("guidellm") / "tokenizer"
    assert travelator_main(["export-tokenizer", str(STORIES), str(tokenizer_dir)]) == 0
    llm = LLM(str(STORIES), dtype="float32")
    app = build_app(AsyncEngine(llm.engine), ServerSettings(served_model_names=[MODEL]))
    with serve_in_thread(app) as url:
        yield url, tokenizer_dir


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_concurrent_profile(served, tmp_path: Path, request_format: str):
    url, tokenizer_dir = served
    report = tmp_path / "report.json"
    guidellm = Path(sys.executable).parent / "guidellm"
    run = subprocess.run(
        [str(guidellm), "run",
         "--backend", f"kind=openai_http,target={url},model={MODEL},request_format={request_format}",
         "--profile", "kind=concurrent,streams=4",
         "--constraint", "kind=max_requests,count=12",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 12, "errored": 0, "incomplete": 0, "total": 12}
    out = metrics["output_token_count"]["successful"]
    assert out["min"] == out["max"] == 16
    assert metrics["output_tokens_per_iteration"]["successful"]["median"] == 1  # a chunk per token
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert 0 < ttft["median"] < 60_000
    assert metrics["output_tokens_per_second"]["successful"]["mean"] > 0
    assert metrics["request_concurrency"]["successful"]["max"] <= 4
