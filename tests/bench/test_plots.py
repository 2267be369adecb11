"""Figures: every plot writes a PNG with something drawn on it, for each kind of result and for
step traces with and without the timing fields."""
import numpy as np
import pytest

from jaxengine.bench import plots, serve
from tests.bench.test_serve_bench import SYNTHETIC

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_drawn(paths) -> None:
    from matplotlib.image import imread

    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        pixels = imread(path)
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 1, f"{path} is blank"


def names(paths) -> list[str]:
    return [p.name for p in paths]


def trace(n: int, timed: bool) -> list[dict]:
    records = []
    for step in range(n):
        record = dict(step=step, num_decode_tokens=step % 5, num_prefill_tokens=8 * (step % 3 == 0),
                      num_preemptions=int(step == 4), num_blocks_swapped_in=2 * (step == 6),
                      num_blocks_swapped_out=2 * (step == 4), kv_usage=step / n, num_waiting=n - step,
                      num_running=min(step, 4), num_swapped=int(4 <= step < 6), num_swap_fallbacks=0)
        if timed:
            record.update(time=100.0 + 0.02 * step, num_rows=4, num_prefix_hit_tokens=4 * (step % 3 == 0),
                          step_s=0.02, host_s=0.005, device_idle_s=0.001 * (step % 2))
        records.append(record)
    return records


def test_serve_result(tmp_path):
    result = {"mode": "serve", **serve.summarise(SYNTHETIC, duration=2.0)}
    paths = plots.plot_result(result, tmp_path / "figures")
    assert names(paths) == ["serve_latency_cdf.png", "serve_throughput_over_time.png"]
    assert all(p.parent == tmp_path / "figures" for p in paths)
    assert_drawn(paths)


def test_latency_samples_come_from_requests_and_top_level_lists():
    result = {"mode": "latency", "latencies": [0.5, 0.25], "step_ms": [3.0], "requests": [
        {"ok": True, "ttft_ms": 10.0, "itl_ms": [1.0, 2.0], "e2e_ms": 13.0, "tpot_ms": None},
        {"ok": False, "ttft_ms": None, "itl_ms": [], "e2e_ms": None, "tpot_ms": None}]}
    assert plots.latency_samples(result) == {"ttft_ms": [10.0], "itl_ms": [1.0, 2.0], "e2e_ms": [13.0],
                                             "latency_ms": [500.0, 250.0], "step_ms": [3.0]}


def test_latency_result(tmp_path):
    paths = plots.plot_result({"mode": "latency", "latencies": [0.5, 0.52, 0.49, 0.61]}, tmp_path)
    assert names(paths) == ["latency_latency_cdf.png"]
    assert_drawn(paths)


def test_throughput_result_with_a_trace(tmp_path):
    result = {"mode": "throughput", "output_throughput": 123.0, "trace": trace(12, timed=False)}
    paths = plots.plot_result(result, tmp_path)
    assert names(paths) == ["trace_tokens.png", "trace_kv_queues.png", "trace_preemptions.png"]
    assert_drawn(paths)


def test_sweep_frontier(tmp_path):
    points = [{"params": {"max_num_seqs": s}, "output_throughput": 100.0 * s,
               "ttft_ms": {"p99": 10.0 * s * s}, "e2e_ms": {"p99": 50.0 * s}} for s in (1, 2, 4)]
    points.append({"label": "nested", "result": {"output_tok_s": 450.0, "ttft_ms": {"p99": 200.0}}})
    paths = plots.plot_result({"mode": "sweep", "points": points}, tmp_path)
    assert names(paths) == ["sweep_frontier.png"]
    assert_drawn(paths)
    assert plots._label(points[1]) == "max_num_seqs=2" and plots._label(points[3]) == "nested"


def test_sweep_without_latencies_draws_no_frontier(tmp_path):
    assert plots.plot_result({"mode": "sweep", "points": [{"output_throughput": 1.0}]}, tmp_path) == []


@pytest.mark.parametrize("timed, expected", [
    (False, ["trace_tokens.png", "trace_kv_queues.png", "trace_preemptions.png"]),
    (True, ["trace_tokens.png", "trace_kv_queues.png", "trace_preemptions.png", "trace_step_time.png"]),
])
def test_trace(tmp_path, timed, expected):
    paths = plots.plot_trace(trace(20, timed), tmp_path)
    assert names(paths) == expected
    assert_drawn(paths)


def test_trace_x_axis_is_time_from_the_first_step_when_present():
    assert plots._trace_x(trace(3, timed=True)) == (pytest.approx([0.0, 0.02, 0.04]), "time (s)")
    assert plots._trace_x(trace(3, timed=False)) == ([0, 1, 2], "step")


def test_an_empty_trace_and_an_unknown_mode(tmp_path):
    assert plots.plot_trace([], tmp_path) == []
    with pytest.raises(ValueError, match="unknown mode 'offline'"):
        plots.plot_result({"mode": "offline"}, tmp_path)


def test_sweep_percentiles_one_line_per_value_of_the_second_axis(tmp_path):
    points = [{"params": {"request_rate": rate, "enable_chunked_prefill": chunked},
               "result": {"output_throughput": 10.0 * rate, "ttft_ms": {"median": rate, "p99": 3.0 * rate},
                          "itl_ms": {"median": 2.0, "p99": 9.0 + chunked}}}
              for rate in (0.5, 1.0, 2.0) for chunked in (False, True)]
    result = {"mode": "sweep", "grid": {"request_rate": [0.5, 1.0, 2.0], "enable_chunked_prefill": [False, True]},
              "points": points}
    paths = plots.plot_result(result, tmp_path)
    assert names(paths) == ["sweep_frontier.png", "sweep_percentiles.png"]
    assert_drawn(paths)
    # a first axis that is not numeric has no x to draw against
    result["grid"] = {"enable_chunked_prefill": [False, True], "request_rate": [0.5, 1.0, 2.0]}
    assert plots.plot_sweep_percentiles(result, tmp_path / "none.png") == []
