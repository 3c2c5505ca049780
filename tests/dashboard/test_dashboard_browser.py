"""The live view in a real browser: Debian's chromium, headless, driven by selenium.

A server under a small load (stories260K, two seats, four long requests: two running, two
waiting); the page must draw the walkway and show the seats, the queue and the KV pool as
/metrics has them at the same moment, a hovered band must name a running request, and once the
requests are gone the page must show the pool at rest exactly as /metrics does. A screenshot of
the page is saved (TRAVELATOR_SCREENSHOT=path to keep it).

Without chromium this test skips, except in CI (TRAVELATOR_REQUIRE_BROWSER=1, set by .ci/run,
which installs the browser), where it fails.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest
from live import serve_in_thread
from paths import STORIES, needs_stories

from travelator import LLM
from travelator.engine.async_engine import AsyncEngine
from travelator.server.app import build_app
from travelator.server.settings import ServerSettings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
REQUIRE = os.environ.get("TRAVELATOR_REQUIRE_BROWSER") == "1"


def browser():
    if not (CHROMIUM and DRIVER):
        message = "chromium and chromedriver are needed (apt-get install chromium chromium-driver)"
        if REQUIRE:
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,800"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("travelator_") and "{" in line:
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def shown(driver) -> dict[str, str]:
    """The figures the page shows, as text."""
    return driver.execute_script("""
        const out = {};
        for (const el of document.querySelectorAll('.panel [data-field]')) out[el.dataset.field] = el.textContent;
        return out;""")


def wait_for(driver, condition, timeout: float = 60.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        figures = shown(driver)
        if condition(figures):
            return figures
        assert time.monotonic() < deadline, f"the page never showed it: {figures}"
        time.sleep(0.1)


@needs_stories
def test_the_live_view_in_a_browser(tmp_path):
    driver = browser()
    engine = AsyncEngine(LLM(str(STORIES), dtype="float32", max_num_seqs=2, block_size=8).engine)
    streams: list[httpx.Response] = []
    with serve_in_thread(build_app(engine, ServerSettings())) as url:
        try:
            # Bands first: six short requests through the two seats.
            shorts = [threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",), kwargs=dict(
                timeout=60, json={"prompt": f"Once upon a time {i}", "max_tokens": 20, "ignore_eos": True}))
                for i in range(6)]
            for t in shorts:
                t.start()
            driver.get(f"{url}/dashboard")
            for t in shorts:
                t.join()
            # Then four long ones, streamed so that closing them aborts them: two run, two wait.
            client = httpx.Client(timeout=120)
            for i in range(4):
                request = client.build_request("POST", f"{url}/v1/completions", json={
                    "prompt": f"The little dog {i}", "max_tokens": 1800, "ignore_eos": True, "stream": True})
                streams.append(client.send(request, stream=True))
            wait_for(driver, lambda f: f["waiting"] == "2" and f["seats-busy"] == "2" and int(f["bands"]) >= 8)
            # The same moment: the page read between two reads of /metrics. The KV in use grows
            # by a block every 8 tokens, so the page's figure lies between the two (less a
            # block or two per request). The page shows a step up to a batch, 50 ms, old: it is
            # read 0.2 s after the first /metrics, so that what it shows is not older than that
            # read (at a token a millisecond, 50 ms are 12 blocks).
            before = metrics(url)
            time.sleep(0.2)
            page = shown(driver)
            server = metrics(url)
            assert page["seats-total"] == "2" and page["seats-busy"] == "2" and page["waiting"] == "2"
            assert server["travelator_num_requests_running"] == 2 and server["travelator_num_requests_waiting"] == 2
            assert int(page["kv-total"]) == server["travelator_kv_cache_total_blocks"]
            used = int(page["kv-used"])
            assert before["travelator_kv_cache_used_blocks"] - 4 <= used <= server["travelator_kv_cache_used_blocks"], (
                before["travelator_kv_cache_used_blocks"], used, server["travelator_kv_cache_used_blocks"])
            assert int(page["admitted"]) == 8 and page["rejected"] == "0"
            assert float(page["tok-s"]) > 0 and page["ttft50"].endswith("ms")
            # The walkway is drawn: pixels in both seats' rows of the canvas.
            rows = driver.execute_script("""
                const c = document.querySelector('.panel canvas'), g = c.getContext('2d');
                const h = c.height / 2, seen = [0, 0];
                for (const seat of [0, 1]) {
                  const d = g.getImageData(0, Math.floor(seat * h), c.width, Math.floor(h)).data;
                  for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 150) seen[seat]++;
                }
                return seen;""")
            assert all(n > 100 for n in rows), rows
            # Hovering the newest step of seat 0 names one of the running requests.
            from selenium.webdriver.common.action_chains import ActionChains
            from selenium.webdriver.common.by import By

            canvas = driver.find_element(By.CSS_SELECTOR, ".panel canvas")
            ActionChains(driver).move_to_element_with_offset(
                canvas, canvas.size["width"] // 2 - 3, -canvas.size["height"] // 4).perform()
            tooltip = driver.find_element(By.ID, "tooltip")
            assert tooltip.is_displayed() and tooltip.text.startswith("cmpl-"), tooltip.text
            assert "state running" in tooltip.text and "prompt" in tooltip.text
            path = os.environ.get("TRAVELATOR_SCREENSHOT") or str(tmp_path / "dashboard.png")
            assert driver.save_screenshot(path)
            # The clients leave: the page shows the pool at rest, exactly as /metrics.
            for s in streams:
                s.close()
            streams.clear()
            page = wait_for(driver, lambda f: f["seats-busy"] == "0" and f["waiting"] == "0")
            server = metrics(url)
            assert server["travelator_num_requests_running"] == 0
            assert int(page["kv-used"]) == server["travelator_kv_cache_used_blocks"] == 0
            assert int(page["kv-cached"]) == server["travelator_kv_cache_cached_blocks"] > 0
            assert int(page["kv-free"]) == server["travelator_kv_cache_free_blocks"] - int(page["kv-cached"])
            client.close()
        finally:  # before the server stops: an open stream would keep it from stopping
            for s in streams:
                s.close()
            driver.quit()


@needs_stories
def test_a_benchmark_replay_in_a_browser(tmp_path):
    """bench compare's walkway.html, opened from disk: both modes play to the end and show
    every request of the run."""
    from travelator.bench.cli import main

    driver = browser()
    try:
        out = tmp_path / "cmp"
        assert main(["compare", "--model", str(STORIES), "--max-num-seqs", "4", "--num-requests", "6",
                     "--prompt-len-range", "4", "12", "--output-len-range", "4", "24", "--request-rates", "inf",
                     "--no-progress", "--output-dir", str(out)]) == 0
        driver.get((out / "walkway.html").as_uri())
        deadline = time.monotonic() + 60
        while "done" not in driver.find_element("id", "status").text:
            assert time.monotonic() < deadline, driver.find_element("id", "status").text
            time.sleep(0.1)
        panels = driver.execute_script("""
            return [...document.querySelectorAll('.panel')].map((p) => Object.fromEntries(
              [...p.querySelectorAll('[data-field]')].map((el) => [el.dataset.field, el.textContent])));""")
        assert [p["title"] for p in panels] == ["static", "iteration"]
        for p in panels:
            assert p["bands"] == "6" and p["admitted"] == "6" and p["seats-total"] == "4", p
    finally:
        driver.quit()
