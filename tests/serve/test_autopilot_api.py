"""The autopilot behind the server: overload is a 503 with Retry-After for new requests only, a
request's own targets come in the ``slo`` extra, and its choices are on /metrics."""
import math

import httpx
import pytest

from jaxengine.autopilot import Autopilot, OnlineCost, Outlook
from jaxengine.config import AutopilotConfig
from jaxengine.lab import constant_profile
from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def complete(server, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 3, "ignore_eos": True, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)


@pytest.fixture
def autopilot(server):
    """The server's engine with an autopilot (2 ms steps, a 500 ms TTFT target) while the test runs."""
    engine = server.engine.engine
    runner, sc = engine.runner, engine.config.scheduler
    autopilot = Autopilot(AutopilotConfig(ttft_s=0.5, itl_s=0.2), OnlineCost(
        constant_profile(0.002), runner.token_buckets, runner.request_buckets), sc, engine.clock)
    server.wait_idle()
    engine.planner = autopilot
    try:
        yield autopilot
    finally:
        engine.planner = None


def test_a_request_predicted_to_miss_its_target_gets_503_with_retry_after(server, autopilot):
    # As if 1,000 prompt tokens were queued ahead at 100 tokens/s with 1 s steps: a new request of
    # 4 tokens would wait (1000 + 4) / 100 + 1 = 11.04 s, 22x its 500 ms target.
    autopilot.outlook = Outlook(queued_tokens=1000, num_waiting=3, prefill_rate=100.0, seat_wait_s=0.0, step_s=1.0)
    before = server.metric("num_requests_overloaded_total")
    r = complete(server)
    assert r.status_code == 503 and r.headers["Retry-After"] == str(math.ceil(11.04 - 0.5))
    assert r.json()["error"]["message"].startswith("overloaded: this request would miss its time-to-first-token target")
    assert server.metric("num_requests_overloaded_total") == before + 1
    # Its own, looser target (60 s) takes it, and it is served in full.
    r = complete(server, slo={"ttft_ms": 60000})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # Served, the engine planned its steps: the outlook is the idle engine's again.
    assert complete(server).status_code == 200
    assert server.metric("autopilot_budget_tokens") > 0 and server.metric("autopilot_cost_correction") > 0


def test_a_bad_slo_extra_is_a_400_naming_the_field(server):
    r = complete(server, slo={"ttft_ms": -1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "slo.ttft_ms: must be a number > 0 (milliseconds), got -1"
