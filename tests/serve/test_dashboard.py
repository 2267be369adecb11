"""The live dashboard: the collector's rolling window, the JSON the page polls after a known
workload, and the page itself in a headless Chromium (Playwright's Python package driving the
system browser; under CI=true a missing browser fails the test instead of skipping it)."""
import dataclasses
import importlib.util
import os
import re
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from jaxengine.engine import StepTrace
from jaxengine.serve.dashboard import DashboardCollector, summary
from tests.serve.conftest import API_KEY, ENGINE, LiveServer, uvicorn_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


# ---------------------------------------------------------------- the collector, on a fake clock
class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def trace(step: int, decode: int, prefill: int, **fields) -> StepTrace:
    state = dict(num_preemptions=0, num_blocks_swapped_in=0, num_blocks_swapped_out=0, kv_usage=0.5, num_waiting=2,
                 num_running=3, num_swapped=0, num_swap_fallbacks=0) | fields
    extra = {f.name: 0 for f in dataclasses.fields(StepTrace) if f.name not in state and f.name not in
             ("step", "num_decode_tokens", "num_prefill_tokens")}    # fields newer than this test
    return StepTrace(step=step, num_decode_tokens=decode, num_prefill_tokens=prefill, **state, **extra)


def request(queued: float, first_token: float):
    return SimpleNamespace(times=SimpleNamespace(queued=queued, first_token=first_token))


def test_percentiles_are_nearest_rank():
    assert summary([float(v) for v in range(100, 0, -1)]) == {"count": 100, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert summary([0.3, 0.1, 0.2]) == {"count": 3, "p50": 0.2, "p90": 0.3, "p99": 0.3}
    assert summary([7.0]) == {"count": 1, "p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert summary([]) == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_latency_samples_older_than_the_window_drop_out():
    clock = FakeClock(1000.0)
    c = DashboardCollector(window_s=60, clock=clock)
    c.on_tokens(request(999.0, 999.5), 1, None)               # TTFT 0.5 s at t=1000
    for i, itl in enumerate([0.04, 0.01, 0.03, 0.02]):       # ITL samples at t=1000, 1010, 1020, 1030
        clock.now = 1000.0 + 10 * i
        c.on_tokens(request(999.0, 999.5), 1, itl)
    clock.now = 1070.0                                       # the window starts at 1010
    latency = c.snapshot()["latency_s"]
    assert latency["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    assert latency["itl"] == {"count": 3, "p50": 0.02, "p90": 0.03, "p99": 0.03}
    clock.now = 1200.0
    assert c.snapshot()["latency_s"]["itl"]["count"] == 0
    assert c.snapshot()["totals"]["output_tokens"] == 5       # totals are since start


def test_at_most_max_samples_are_kept():
    clock = FakeClock()
    c = DashboardCollector(max_samples=3, clock=clock)
    for itl in (0.9, 0.1, 0.2, 0.3):
        c.on_tokens(request(0.0, 1.0), 1, itl)
    assert c.snapshot()["latency_s"]["itl"] == {"count": 3, "p50": 0.2, "p90": 0.3, "p99": 0.3}


def test_speculative_drafts_and_their_acceptance_are_summed():
    clock = FakeClock(1000.0)
    c = DashboardCollector(window_s=10, clock=clock)
    engine = SimpleNamespace(last_trace=None)
    for now, (drafted, accepted) in ((1000.0, (8, 6)), (1001.0, (4, 1)), (1002.0, (0, 0))):
        clock.now, engine.last_trace = now, trace(0, 2, 0, num_draft_tokens=drafted, num_accepted_tokens=accepted)
        c.on_step(engine)
    clock.now = 1003.0
    s = c.snapshot()
    assert (s["totals"]["num_draft_tokens"], s["totals"]["num_accepted_tokens"]) == (12, 7)
    assert s["per_second"]["num_draft_tokens"][-3:] == [8, 4, 0]
    assert (s["last_minute"]["num_draft_tokens"], s["last_minute"]["num_accepted_tokens"]) == (12, 7)
    page = (Path(__file__).resolve().parents[2] / "jaxengine/serve/static/dashboard.html").read_text()
    assert 'id="spec-card"' in page and "minute.num_accepted_tokens / minute.num_draft_tokens" in page


def test_per_second_sums_rate_and_recent_steps():
    clock = FakeClock(1000.2)
    c = DashboardCollector(window_s=10, step_history=3, clock=clock)
    engine = SimpleNamespace(last_trace=None)
    for now, step in ((1000.2, trace(0, 0, 20)), (1000.7, trace(1, 1, 0)), (1002.5, trace(2, 2, 5, num_preemptions=1)),
                      (1003.1, trace(3, 2, 0, num_blocks_swapped_out=4))):
        clock.now, engine.last_trace = now, step
        c.on_step(engine)
        c.on_tokens(request(999.0, 1000.0), step.num_decode_tokens or 1, None)
    c.on_finish(request(999.0, 1000.0))
    clock.now = 1004.0
    s = c.snapshot()
    assert s["per_second"]["steps"] == [0] * 6 + [2, 0, 1, 1]                   # seconds 994 .. 1003
    assert s["per_second"]["num_prefill_tokens"] == [0] * 6 + [20, 0, 5, 0]
    assert s["per_second"]["output_tokens"] == [0] * 6 + [2, 0, 2, 2]
    assert s["per_second"]["finished"] == [0] * 9 + [1]
    assert s["output_tokens_per_s"] == 6 / 5                                    # the last 5 whole seconds
    assert {k: s["last_minute"][k] for k in ("steps", "num_decode_tokens", "num_preemptions",
                                             "num_blocks_swapped_out", "finished")} == {
        "steps": 4, "num_decode_tokens": 5, "num_preemptions": 1, "num_blocks_swapped_out": 4, "finished": 1}
    assert s["recent_steps"]["step"] == [1, 2, 3]
    assert s["recent_steps"]["num_decode_tokens"] == [1, 2, 2]
    assert s["queues"] == {"num_waiting": 2, "num_running": 3, "num_swapped": 0, "kv_usage": 0.5}
    clock.now = 1100.0                                       # a quiet minute later
    s = c.snapshot()
    assert s["last_minute"]["steps"] == 0 and s["output_tokens_per_s"] == 0
    assert (s["totals"]["steps"], s["totals"]["output_tokens"], s["totals"]["num_prefill_tokens"]) == (4, 6, 25)


def test_idle_sets_the_queues_from_the_engine():
    c = DashboardCollector(clock=FakeClock())
    stats = SimpleNamespace(num_waiting=0, num_running=0, num_swapped=1, kv_usage=0.25)
    c.on_idle(SimpleNamespace(stats=lambda: stats))
    assert c.snapshot()["queues"] == {"num_waiting": 0, "num_running": 0, "num_swapped": 1, "kv_usage": 0.25}


# ---------------------------------------------------------------- a live server
@pytest.fixture(scope="module")
def dash(chat_checkpoint):
    """A server of its own (steps counted from zero), without async scheduling: one token per
    step and per delivery, so a workload's numbers are known exactly."""
    from jaxengine.llm import LLM
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    llm = LLM(chat_checkpoint, **{**ENGINE, "async_scheduling": False})
    metrics = EngineMetrics("tiny")
    engine = AsyncEngine(llm, observer=metrics)
    app = build_app(engine, served_model_name="tiny", metrics=metrics, api_key=API_KEY)
    with uvicorn_thread(app) as url:
        yield LiveServer(url, llm, engine, metrics)


def state(url: str) -> dict:
    r = httpx.get(f"{url}/dashboard/state", headers=AUTH)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    return r.json()


def complete(url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_the_page_is_open_and_self_contained_and_its_data_takes_the_key(dash):
    page = httpx.get(f"{dash.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert re.findall(r'(?:src|href)="([^"]*)"', page.text) == ["data:,"]          # nothing fetched from elsewhere
    assert httpx.get(f"{dash.url}/dashboard/state").status_code == 401
    assert httpx.get(f"{dash.url}/dashboard/state", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_state_after_a_known_workload(dash):
    """Three requests one after another: 20-token prompts (no shared block, so no prefix-cache
    hit), 5 tokens each. Each is one prefill step (its first token) and 4 decode steps."""
    dash.wait_idle()
    before = state(dash.url)
    for first in (10, 40, 70):
        complete(dash.url, list(range(first, first + 20)), max_tokens=5)
    dash.wait_idle()
    time.sleep(1.0)                    # the second of the last step is whole: it shows in the series
    after = state(dash.url)
    counted = ("steps", "output_tokens", "finished", "num_decode_tokens", "num_prefill_tokens", "num_preemptions",
               "num_blocks_swapped_in", "num_blocks_swapped_out", "num_swap_fallbacks")
    expected = dict(steps=15, output_tokens=15, finished=3, num_decode_tokens=12, num_prefill_tokens=60,
                    num_preemptions=0, num_blocks_swapped_in=0, num_blocks_swapped_out=0, num_swap_fallbacks=0)
    for part in ("totals", "last_minute"):
        assert {k: after[part][k] - before[part][k] for k in counted} == expected, part
    recent = after["recent_steps"]
    assert list(zip(recent["num_prefill_tokens"], recent["num_decode_tokens"]))[-15:] == [(20, 0)] + [(0, 1)] * 4 + \
        [(20, 0)] + [(0, 1)] * 4 + [(20, 0)] + [(0, 1)] * 4
    assert recent["num_running"][-5:] == [1, 1, 1, 1, 0]
    assert after["queues"] == {"num_waiting": 0, "num_running": 0, "num_swapped": 0, "kv_usage": 0.0}
    for kind, count in (("ttft", 3), ("itl", 12)):
        latency = after["latency_s"][kind]
        assert latency["count"] - before["latency_s"][kind]["count"] == count
        assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    assert (after["model"], after["health"], after["replicas"]) == ("tiny", None, [])


def test_settings_are_the_engine_args(dash):
    settings = state(dash.url)["settings"]
    assert settings["engine_args"] == dataclasses.asdict(dash.host.engine_args)
    assert settings["engine_args"]["max_num_batched_tokens"] == 64 and settings["engine_args"]["num_kv_blocks"] == 400
    assert settings["resolved"] == {"max_model_len": 128, "max_num_batched_tokens": 64, "max_num_seqs": 32,
                                    "block_size": 4, "num_gpu_blocks": 400,
                                    "num_cpu_blocks": dash.host.config.cache.num_cpu_blocks, "async_scheduling": False,
                                    "dtype": "float32", "platform": "cpu", "replicas": 1, "scheduling_policy": "fcfs"}


# ---------------------------------------------------------------- the page in a browser
@pytest.fixture(scope="module")
def chromium() -> str:
    """The system Chromium's path; a missing browser skips the test, except under CI=true, where
    it fails (CI installs one, so the test never silently skips there)."""
    path = shutil.which("chromium")
    why = "no chromium on PATH (apt-get install -y chromium; `playwright install` is not needed)"
    if importlib.util.find_spec("playwright") is None:
        path, why = None, "the playwright package is not installed (pip install playwright)"
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the dashboard's browser test needs a browser under CI: {why}")
        pytest.skip(why)
    return path


class Load:
    """Requests sent back to back by a few client threads until ``stop()``."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url, self.done = url, threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        while not self.done.is_set():
            complete(self.url, [100 + i, *range(20, 40)], max_tokens=48)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(60)


def number(page, element_id: str) -> float:
    return float(page.text_content(f"#{element_id}").replace(",", ""))


def wait_updates(page, count: int = 2) -> None:
    """Until the page has applied ``count`` more polls."""
    seen = int(page.get_attribute("body", "data-updates") or 0)
    page.wait_for_function(f"Number(document.body.dataset.updates || 0) >= {seen + count}", timeout=15_000)


def test_the_page_follows_the_load_in_a_browser(chromium, dash):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    errors, elsewhere = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith((dash.url, "data:")) else elsewhere.append(r.url))
        page.add_init_script(f"sessionStorage.setItem('jaxengine-api-key', {API_KEY!r})")
        page.goto(f"{dash.url}/dashboard")
        wait_updates(page, 1)
        idle_steps = number(page, "steps")
        assert page.text_content("#model") == "tiny"
        assert page.locator("#settings > div").count() == len(dataclasses.asdict(dash.host.engine_args))
        assert page.locator("#resolved > div").count() == 11
        with Load(dash.url):
            page.wait_for_function("Number(document.getElementById('running').textContent) > 0", timeout=15_000)
            first = number(page, "steps")
            wait_updates(page)
            assert first > idle_steps and number(page, "steps") > first          # it moves while requests run
            page.wait_for_function("Number(document.getElementById('tok-s').textContent.replace(/,/g, '')) > 0",
                                   timeout=15_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        page.wait_for_function("document.getElementById('running').textContent === '0' && "
                               "document.getElementById('waiting').textContent === '0'", timeout=15_000)
        wait_updates(page)
        settled = number(page, "steps")
        wait_updates(page)
        assert number(page, "steps") == settled and page.text_content("#kv") == "0.0 %"
        assert page.locator("#budget-chart rect").count() == 2 * 120
        assert page.locator("#rate-chart polyline").count() == 1
        browser.close()
    assert errors == [] and elsewhere == []
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_the_page_asks_for_the_key(chromium, dash):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{dash.url}/dashboard")
        page.wait_for_selector("#key-form:not([hidden])", timeout=15_000)
        assert page.text_content("#status") == "API key needed"
        page.fill("#key", API_KEY)
        page.click("#key-form button")
        wait_updates(page, 1)
        assert page.text_content("#model") == "tiny" and page.is_hidden("#key-form")
        browser.close()


def test_the_autopilots_targets_attainment_and_knobs_in_a_browser(chromium, dash):
    from playwright.sync_api import sync_playwright

    from jaxengine.autopilot import Autopilot, OnlineCost
    from jaxengine.config import AutopilotConfig
    from jaxengine.lab import constant_profile

    engine = dash.engine.engine
    engine.planner = Autopilot(AutopilotConfig(ttft_s=5.0, itl_s=1.0), OnlineCost(
        constant_profile(0.002), engine.runner.token_buckets, engine.runner.request_buckets),
        engine.config.scheduler, engine.clock)
    errors = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.add_init_script(f"sessionStorage.setItem('jaxengine-api-key', {API_KEY!r})")
            page.goto(f"{dash.url}/dashboard")
            with Load(dash.url):
                page.wait_for_function("document.getElementById('slo-value').textContent.includes('ITL')",
                                       timeout=15_000)
                wait_updates(page)
                page.screenshot(path=str(ARTIFACTS / "dashboard-autopilot.png"), full_page=True)
                # Tiny steps against targets of seconds: everything within them.
                assert page.text_content("#slo-value") == "TTFT 100.0 % · ITL 100.0 %"
                assert page.text_content("#knobs-value").endswith("seqs")
            assert page.locator("#step-time-chart polyline").count() == 2       # measured, predicted
            assert page.locator("#seqs-chart polyline").count() == 2
            assert page.locator("#budget-chart polyline").count() == 1          # the budget of each step
            browser.close()
    finally:
        engine.planner = None
    assert errors == []
    assert state(dash.url)["settings"]["autopilot"] is None
