"""python -m jaxengine.lab: simulate, tune and whatif from the command line, and their errors."""
import json

import pytest

from jaxengine.lab.__main__ import main
from jaxengine.costmodel.profile import CostProfile
from jaxengine.costmodel.roofline import roofline_profile

PROFILE = CostProfile({16: [0.01, 0, 1e-4, 1e-6, 0], 256: [0.02, 0, 1e-4, 2e-6, 0], 512: [0.2, 0, 0, 0, 0]},
                      num_gpu_blocks=2000)


@pytest.fixture
def profile_file(tmp_path):
    return str(PROFILE.save(tmp_path / "profile.json"))


def test_simulate_writes_a_bench_style_result_and_its_figures(tmp_path, profile_file, capsys):
    out = tmp_path / "sim.json"
    main(["simulate", "--profile", profile_file, "--num-requests", "40", "--request-rate", "20",
          "--input-len", "64", "--output-len", "8", "--slo", "ttft_ms=500", "--max-num-batched-tokens", "256",
          "--result-file", str(out), "--plot", str(tmp_path / "fig")])
    result = json.loads(out.read_text())
    assert result["mode"] == "serve" and result["simulated"] is True
    assert result["completed"] == 40 and result["total_output_tokens"] == 320
    assert result["config"]["engine_options"] == {"max_num_batched_tokens": 256}
    assert "goodput" in result and result["trace"]
    assert (tmp_path / "fig" / "serve_latency_cdf.png").exists()
    assert "simulated in" in capsys.readouterr().out


def test_simulate_speculation_with_an_acceptance_fitted_to_a_trace(tmp_path, profile_file):
    """The trace of one simulated run gives back its acceptance; a second run fitted to it."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    common = ["simulate", "--profile", profile_file, "--num-requests", "4", "--input-len", "16", "--output-len",
              "64", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--no-noise"]
    main([*common, "--acceptance", "0.75", "--result-file", str(first)])
    trace = json.loads(first.read_text())["trace"]
    assert sum(t["num_draft_tokens"] for t in trace) > 0
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trace))
    main([*common, "--acceptance-from-trace", str(tmp_path / "t.jsonl"), "--result-file", str(second)])
    result = json.loads(second.read_text())
    assert abs(result["config"]["acceptance"] - 0.75) < 0.1
    assert result["config"]["engine_options"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}


def test_tune_prints_the_serve_flags(tmp_path, profile_file, capsys):
    out = tmp_path / "tune.json"
    main(["tune", "--profile", profile_file, "--num-requests", "60", "--input-len", "32", "--output-len", "8",
          "--slo", "itl_ms=100", "--max-rounds", "1", "--no-progress", "--result-file", str(out),
          "--plot", str(tmp_path / "fig")])
    result = json.loads(out.read_text())
    assert result["recommended_flags"] == ["--max-num-batched-tokens", "256"] or \
        "--max-num-batched-tokens" in result["recommended_flags"]
    assert "recommended: python -m jaxengine.serve" in capsys.readouterr().out
    assert (tmp_path / "fig" / "tune_frontier.png").exists()


def test_whatif_on_a_roofline_model_says_it_is_not_a_measurement(tmp_path, capsys):
    out = tmp_path / "whatif.json"
    main(["whatif", "--hardware", "h200", "--model-shape", "llama-3-8b", "--num-requests", "100",
          "--input-len", "512", "--output-len", "64", "--slo", "ttft_ms=1000", "--slo", "itl_ms=50",
          "--max-num-batched-tokens", "2048", "--max-num-seqs", "128", "--result-file", str(out)])
    result = json.loads(out.read_text())
    assert result["requests_per_s"] > 1
    assert result["attainment"] >= 0.9
    assert "not a measurement" in result["note"] and "not a measurement" in capsys.readouterr().out
    assert result["profile"]["kind"] == "roofline"


@pytest.mark.parametrize("argv, message", [
    (["tune", "--num-requests", "5"], "give at least one --slo"),
    (["whatif", "--slo", "ttft_ms=1"], "either --hardware"),
    (["simulate", "--profile", "missing.json"], "cannot read"),
    (["simulate", "--input-len", "x:y:z:w"], "length"),
    (["calibrate", "--from-trace", "t.jsonl"], "--num-kv-blocks"),
])
def test_errors_name_what_is_wrong(argv, message, profile_file):
    argv = [a if a != "--profile" else a for a in argv]
    if argv[0] in ("tune", "simulate") and "--profile" not in argv:
        argv += ["--profile", profile_file]
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_calibrate_fits_a_recorded_trace(tmp_path):
    from jaxengine.trace import StepTrace, TraceWriter

    with TraceWriter(tmp_path / "t.jsonl") as w:
        for i in range(12):
            rows = 1 + i % 4
            w.write(StepTrace(i, i * 0.1, rows, rows, 8 * (i % 3), 0, 0, 0, 0, 0.1, 0, 0, rows, 0,
                              0.01 + 0.002 * rows, 0.0, 0.0, 64 + i, 64 * rows))
    result = main(["calibrate", "--from-trace", str(tmp_path / "t.jsonl"), "--num-kv-blocks", "300",
                   "--max-num-batched-tokens", "64", "--result-file", str(tmp_path / "p.json")])
    assert result["num_gpu_blocks"] == 300 and result["fit_error"]["num_steps"] == 11
    assert result["fit_error"]["max_abs_pct"] < 1e-6


def test_calibrate_scales_a_profile_to_a_servers_trace(tmp_path, profile_file):
    from jaxengine.engine_args import EngineArgs
    from jaxengine.costmodel.profile import StepShape, load_profile
    from jaxengine.trace import StepTrace, TraceWriter

    shapes = [StepShape(r, r, 100 + i, 100 * r) for i, r in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4])]
    buckets = EngineArgs(max_num_batched_tokens=256, max_num_seqs=16).step_buckets()
    with TraceWriter(tmp_path / "t.jsonl") as w:      # a server 1.5x slower than the profile says
        w.write(StepTrace(0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 9.0, 0, 0, 100, 100))     # compile: skipped
        for i, s in enumerate(shapes, 1):
            step_s = 1.5 * PROFILE.step_seconds(*s.bucketed(*buckets))
            w.write(StepTrace(i, i, s.num_rows, s.num_tokens, 0, 0, 0, 0, 0, 0, 0, 0, s.num_rows, 0, step_s, 0, 0,
                              s.max_context, s.sum_context))
    main(["calibrate", "--from-trace", str(tmp_path / "t.jsonl"), "--profile", profile_file,
          "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--result-file", str(tmp_path / "adj.json")])
    adjusted = load_profile(tmp_path / "adj.json")
    assert adjusted.source["adjusted_to_trace"]["factor"] == pytest.approx(1.5)
    assert adjusted.coefficients[256] == pytest.approx([1.5 * c for c in PROFILE.coefficients[256]])
    assert adjusted.noise[0] == pytest.approx(1.0) and adjusted.noise[-1] == pytest.approx(1.0)
    roofline = roofline_profile("h200").save(tmp_path / "roofline.json")
    with pytest.raises(SystemExit, match="a measured profile"):
        main(["calibrate", "--profile", str(roofline)])
