"""The serving benchmark: its report from synthetic requests (exact), and its load on a live
server on the tiny model at a fixed concurrency and at a Poisson rate."""
import argparse
import math

import httpx
import pytest

from jaxengine.bench import serve
from jaxengine.bench.serve import RequestResult
from tests.serve.conftest import API_KEY, LiveServer

OUTPUT_LEN = 5


@pytest.fixture
def live(server):
    """The tests' shared live server on the tiny chat model (its counters are read as deltas)."""
    return server


# ---- the report, from synthetic requests ----
SYNTHETIC = [
    RequestResult(prompt_tokens=3, output_tokens=4, start_s=0.0, ttft_s=0.1, e2e_s=0.4,
                  chunk_times_s=[0.1, 0.2, 0.3, 0.4]),
    RequestResult(prompt_tokens=5, output_tokens=5, start_s=0.5, ttft_s=0.2, e2e_s=1.3,
                  chunk_times_s=[0.7, 1.1, 1.8]),             # 5 tokens in 3 chunks: 1, 2, 2
    RequestResult(start_s=1.0, error="HTTP 503: busy"),
]


def test_report_of_synthetic_requests():
    report = serve.summarise(SYNTHETIC, duration=2.0, slos={"ttft_ms": 150})
    assert {k: report[k] for k in ("num_requests", "completed", "failed", "total_input_tokens",
                                   "total_output_tokens", "errors")} == {
        "num_requests": 3, "completed": 2, "failed": 1, "total_input_tokens": 8, "total_output_tokens": 9,
        "errors": ["HTTP 503: busy"]}
    assert report["request_throughput"] == 1.0
    assert report["output_throughput"] == 4.5
    assert report["total_token_throughput"] == 8.5
    assert report["goodput"] == 0.5                              # only the first meets TTFT <= 150 ms
    assert report["ttft_ms"] == pytest.approx({"mean": 150, "median": 150, "p90": 190, "p99": 199, "max": 200})
    assert report["tpot_ms"] == pytest.approx({"mean": 187.5, "median": 187.5, "p90": 257.5, "p99": 273.25,
                                               "max": 275})   # 300 ms / 3 and 1,100 ms / 4
    assert report["itl_ms"] == pytest.approx({"mean": 280, "median": 100, "p90": 580, "p99": 688, "max": 700})
    assert report["throughput_over_time"] == {"t_s": [0, 1], "output_tokens": [5, 4]}
    assert [r["ok"] for r in report["requests"]] == [True, True, False]
    assert report["requests"][1]["itl_ms"] == pytest.approx([400, 700])
    assert report["requests"][2]["ttft_ms"] is None


def test_no_successful_request_gives_empty_percentiles():
    report = serve.summarise(SYNTHETIC[2:], duration=1.0)
    assert report["ttft_ms"] == dict.fromkeys(("mean", "median", "p90", "p99", "max"))
    assert "goodput" not in report


@pytest.mark.parametrize("choice, carries", [
    ({"index": 0, "text": "a", "finish_reason": None}, True),
    ({"index": 0, "text": "", "finish_reason": None}, True),         # a token held back mid-character
    ({"index": 0, "text": "", "finish_reason": "length"}, False),    # finish only
    ({"index": 0, "text": "b", "finish_reason": "length"}, True),
    ({"index": 0, "delta": {"role": "assistant", "content": ""}}, False),
    ({"index": 0, "delta": {"role": "assistant", "content": "Hi"}}, True),
    ({"index": 0, "delta": {"content": ""}}, True),
    ({"index": 0, "delta": {}, "finish_reason": "stop"}, False),
])
def test_which_chunks_carry_tokens(choice, carries):
    assert serve.carries_tokens(choice) is carries


def test_arrival_gaps():
    assert serve.arrival_gaps(3, math.inf) == [0.0, 0.0, 0.0]
    poisson = serve.arrival_gaps(20000, 4.0, 1.0, seed=1)
    bursty = serve.arrival_gaps(20000, 4.0, 0.25, seed=1)
    assert poisson == serve.arrival_gaps(20000, 4.0, 1.0, seed=1)
    for gaps, cv in ((poisson, 1.0), (bursty, 2.0)):             # gamma: coefficient of variation 1 / sqrt(k)
        mean = sum(gaps) / len(gaps)
        std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
        assert mean == pytest.approx(0.25, rel=0.05) and std / mean == pytest.approx(cv, rel=0.05)


def test_random_prompts():
    words = serve.random_word_prompts(3, 4, 7, seed=2)
    assert words == serve.random_word_prompts(3, 4, 7, seed=2)
    assert [len(p.split()) for p, _ in words] == [4, 4, 4] and [n for _, n in words] == [7, 7, 7]
    ids = serve.random_token_prompts(2, 5, 3, low=10, high=12, seed=0)
    assert [len(p) for p, _ in ids] == [5, 5] and {t for p, _ in ids for t in p} <= {10, 11}


@pytest.mark.parametrize("url, allowed", [
    ("http://127.0.0.1:8000/v1", True), ("http://localhost:8000/v1", True), ("http://[::1]:8000/v1", True),
    ("http://127.3.4.5/v1", True), ("http://10.0.0.1:8000/v1", False), ("https://api.example.com/v1", False),
])
def test_loopback_guard(url, allowed):
    if allowed:
        serve.check_loopback(url)
    else:
        with pytest.raises(ValueError, match="--allow-remote"):
            serve.check_loopback(url)
    serve.check_loopback(url, allow_remote=True)


def test_run_refuses_a_remote_server_before_sending_anything():
    args = parse(["--base-url", "http://192.0.2.1:8000/v1", "--model", "m"])
    with pytest.raises(ValueError, match="not a loopback address"):
        serve.run(args)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


# ---- live: the tiny model behind our server ----
def prompt_tokens(live: LiveServer, prompts, endpoint: str) -> int:
    """What the server counts: each prompt through its /tokenize (with the chat template for chat)."""
    def body(prompt):
        return {"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat" else {"prompt": prompt}

    return sum(httpx.post(f"{live.url}/tokenize", json=body(p)).json()["count"] for p, _ in prompts)


def check_consistent(result: dict, prompts, live: LiveServer, before: tuple[float, float],
                     endpoint: str = "completions") -> None:
    n = len(prompts)
    assert (result["num_requests"], result["completed"], result["failed"]) == (n, n, 0)
    assert [r["output_tokens"] for r in result["requests"]] == [OUTPUT_LEN] * n     # usage, ignore_eos
    assert result["total_output_tokens"] == n * OUTPUT_LEN
    expected_prompt_tokens = prompt_tokens(live, prompts, endpoint)
    assert result["total_input_tokens"] == expected_prompt_tokens
    assert sum(result["throughput_over_time"]["output_tokens"]) == n * OUTPUT_LEN
    live.wait_idle()
    assert live.metric("generation_tokens_total") - before[1] == n * OUTPUT_LEN
    assert live.metric("prompt_tokens_total") - before[0] == expected_prompt_tokens
    for r in result["requests"]:
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert len(r["itl_ms"]) <= OUTPUT_LEN - 1
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (OUTPUT_LEN - 1))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = result[key]
        assert p["median"] <= p["p90"] <= p["p99"] <= p["max"], key
    assert result["output_throughput"] == pytest.approx(n * OUTPUT_LEN / result["duration_s"])
    assert result["goodput"] <= result["request_throughput"]


def counters(live: LiveServer) -> tuple[float, float]:
    return live.metric("prompt_tokens_total"), live.metric("generation_tokens_total")


def test_fixed_concurrency_against_the_live_server(live):
    prompts = serve.random_word_prompts(10, 4, OUTPUT_LEN, seed=0)
    before = counters(live)
    result = serve.benchmark(f"{live.url}/v1", prompts, max_concurrency=3, api_key=API_KEY, progress=False,
                             extra_body={"ignore_eos": True, "temperature": 0}, slos={"ttft_ms": 1e9})
    assert result["model"] == "tiny"                           # discovered from /v1/models
    check_consistent(result, prompts, live, before)
    assert result["goodput"] == result["request_throughput"]   # an SLO every request meets
    spans = [(r["start_s"], r["start_s"] + r["e2e_ms"] / 1e3) for r in result["requests"]]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 3


def test_poisson_rate_on_chat_through_the_command_line(live, monkeypatch):
    prompts = serve.random_word_prompts(6, 3, OUTPUT_LEN, seed=1)
    monkeypatch.setattr(serve, "prompts_from_args", lambda args: prompts)
    args = parse(["--base-url", f"{live.url}/v1", "--endpoint", "chat", "--request-rate", "20", "--seed", "3",
                  "--num-prompts", "6", "--ignore-eos", "--slo", "ttft_ms=0.001", "--slo", "tpot_ms=100000",
                  "--api-key", API_KEY, "--no-progress"])
    before = counters(live)
    result = serve.run(args)
    assert result["config"] == {"base_url": f"{live.url}/v1", "endpoint": "chat", "request_rate": 20.0,
                                "burstiness": 1.0, "max_concurrency": None, "num_prompts": 6, "max_duration": None,
                                "slo": {"ttft_ms": 0.001, "tpot_ms": 100000.0}}
    check_consistent(result, prompts, live, before, endpoint="chat")
    assert result["goodput"] == 0.0                             # nobody answers within a microsecond
    starts = [r["start_s"] for r in result["requests"]]
    assert starts == sorted(starts)
    assert result["duration_s"] >= sum(serve.arrival_gaps(6, 20.0, 1.0, seed=3)[:-1])


def test_max_duration_stops_sending(live):
    prompts = serve.random_word_prompts(50, 3, OUTPUT_LEN, seed=2)
    result = serve.benchmark(f"{live.url}/v1", prompts, model="tiny", request_rate=2.0, max_duration=1.0,
                             api_key=API_KEY, progress=False, extra_body={"ignore_eos": True})
    # The seeded gaps (arrival_gaps(50, 2.0, seed=0)) start requests at 0, 0.34, 0.85, 0.86 and
    # 0.861 s; the sixth would start at 1.136 s, past the 1 s limit.
    assert result["num_requests"] == 5
    assert all(r["start_s"] < 1.0 for r in result["requests"])
    assert result["failed"] == 0


# ---- a server launched for the run ----
LAUNCH_ENGINE = ["--max-num-batched-tokens", "32", "--max-num-seqs", "3", "--request-buckets", "3",
                 "--num-kv-blocks", "77", "--max-model-len", "64", "--no-enable-prefix-caching"]


def test_launch_serves_the_run_with_the_given_engine_options(chat_checkpoint, tmp_path):
    from jaxengine.bench.__main__ import main

    result = main(["serve", "--launch", "--model", str(chat_checkpoint), *LAUNCH_ENGINE, "--num-prompts", "4",
                   "--input-len", "3", "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--max-concurrency", "2",
                   "--no-progress", "--result-file", str(tmp_path / "r.json")])
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 4 * OUTPUT_LEN)
    assert result["config"]["base_url"].startswith("http://127.0.0.1:")
    assert result["config"]["base_url"] != serve.DEFAULT_BASE_URL
    assert result["engine_args"]["model"] == str(chat_checkpoint) and result["engine_args"]["max_num_seqs"] == 3
    given, resolved = result["server_settings"]["engine_args"], result["server_settings"]["resolved"]
    assert given == result["engine_args"]                       # the launched server got every option
    assert (resolved["max_num_seqs"], resolved["num_gpu_blocks"], resolved["max_model_len"]) == (3, 77, 64)


def test_engine_options_without_launch_are_refused():
    args = parse(["--max-num-seqs", "3", "--model", "m"])
    with pytest.raises(ValueError, match="engine options configure a launched server: add --launch"):
        serve.run(args)


def test_a_launched_server_that_fails_to_start_says_why(tmp_path):
    from jaxengine.bench.launch import launched_server
    from jaxengine.engine_args import EngineArgs

    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match=r"(?s)exited with status [1-9].*no-such-model"):
        with launched_server(EngineArgs(model=str(missing))):
            pass
