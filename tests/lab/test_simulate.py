"""The simulator: hand-computed timelines on a constant-cost profile, the same scheduling decisions
as the engine on a KV-checking runner, replayed traces, figures."""
import json
import math

import pytest

from jaxengine.engine import Engine
from jaxengine.costmodel.profile import CostProfile, StepShape, constant_profile
from jaxengine.lab.simulate import engine_config, simulate
from jaxengine.lab.workload import SimRequest, Workload, from_bench_result, from_jsonl
from jaxengine.engine_args import EngineArgs
from jaxengine.buckets import step_row_buckets, token_buckets
from jaxengine.testing.fake_runner import HashRunner
from jaxengine.sampling_params import SamplingParams

STEP = 0.010
SMALL = dict(block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)


def prompt(n, start=1):
    return tuple(range(start, start + n))


def test_two_requests_on_a_constant_profile_follow_the_hand_computed_timeline():
    # t=0: A arrives; step 1 [0, 10 ms] prefills A (first token at 10 ms); step 2 decodes A (20 ms);
    # B (arrived at 15 ms) joins step 3 beside A's last decode: B's first token at 30 ms; steps 4 and
    # 5 decode B (40, 50 ms).
    requests = [SimRequest(0.0, prompt(8), 3), SimRequest(0.015, prompt(8, 100), 3)]
    result = simulate(requests, constant_profile(STEP, num_gpu_blocks=64, block_size=4), **SMALL)
    a, b = result.metrics["requests"]
    assert a["ttft_ms"] == pytest.approx(10) and a["e2e_ms"] == pytest.approx(30)
    assert b["ttft_ms"] == pytest.approx(15) and b["e2e_ms"] == pytest.approx(35)
    assert a["itl_ms"] == pytest.approx([10, 10]) and b["itl_ms"] == pytest.approx([10, 10])
    assert (a["output_tokens"], b["output_tokens"]) == (3, 3)
    assert result.num_steps == 5
    assert [t["num_prefill_tokens"] for t in result.trace] == [8, 0, 8, 0, 0]
    assert result.metrics["duration_s"] == pytest.approx(0.050)


def test_a_chunked_prompt_and_the_delay_factor_move_the_first_token_as_computed():
    # 100 prompt tokens in a budget of 64: two prefill steps, the first token at 20 ms.
    chunked = simulate([SimRequest(0.0, prompt(100), 2)], constant_profile(STEP, num_gpu_blocks=64, block_size=4),
                       **SMALL)
    assert chunked.metrics["requests"][0]["ttft_ms"] == pytest.approx(20)
    # delay factor 2: a prompt arriving while A decodes waits until the oldest waiting request has
    # waited more than 2 x the last prompt step's latency (10 ms): B (at 5 ms) joins the step at 30 ms.
    requests = [SimRequest(0.0, prompt(8), 6), SimRequest(0.005, prompt(8, 100), 1)]
    delayed = simulate(requests, constant_profile(STEP, num_gpu_blocks=64, block_size=4),
                       scheduler_delay_factor=2.0, **SMALL)
    assert delayed.metrics["requests"][1]["ttft_ms"] == pytest.approx(35)
    eager = simulate(requests, constant_profile(STEP, num_gpu_blocks=64, block_size=4), **SMALL)
    assert eager.metrics["requests"][1]["ttft_ms"] == pytest.approx(15)


def test_goodput_counts_the_requests_within_every_slo():
    requests = [SimRequest(0.0, prompt(8), 3), SimRequest(0.015, prompt(8, 100), 3)]
    result = simulate(requests, constant_profile(STEP, num_gpu_blocks=64, block_size=4),
                      slos={"ttft_ms": 12}, **SMALL)
    assert result.metrics["goodput"] == pytest.approx(1 / 0.050)         # only A's TTFT is within 12 ms


def replay_on_the_engine(requests, config, profile, buckets):
    """The engine with the KV-checking fake runner, driven on a clock the profile moves."""
    clock = [0.0]
    runner = HashRunner(config.cache.num_gpu_blocks, config.cache.num_cpu_blocks, config.cache.block_size)
    engine = Engine(config, runner, clock=lambda: clock[0])
    outputs, pending = [], sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]].arrival_s <= clock[0]:
            i = pending.pop(0)
            r = requests[i]
            engine.add_request(str(i), list(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.output_len, ignore_eos=True, n=r.n,
                                              temperature=1.0 if r.n > 1 else 0.0),
                               priority=r.priority, arrival_time=r.arrival_s)
        if not engine.has_unfinished_requests():
            clock[0] = requests[pending[0]].arrival_s
            continue
        engine.step()
        out = engine.last_output
        shape = StepShape.of_output(out)
        rows = step_row_buckets(config.scheduler.max_num_seqs)
        clock[0] += profile.step_seconds(*shape.bucketed(buckets, rows)) if shape.num_tokens else 1e-4
        outputs.append(out)
    return outputs


def decisions(out):
    return ([(s.request.request_id, s.sample_index, n, k) for s, n, k in
             zip(out.scheduled_seqs, out.num_scheduled_tokens, out.num_samples)],
            out.num_preemptions, len(out.blocks_to_swap_out), len(out.blocks_to_swap_in), out.num_prefix_hit_tokens)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "shortest-prompt-first", "longest-cached-prefix-first"])
def test_simulator_and_engine_take_the_same_scheduling_decisions(policy):
    workload = Workload(num_requests=40, request_rate=200.0, input_len="4:60", output_len="1:40",
                        shared_prefix_len=8, num_prefixes=2, priorities={0: 1, 1: 1}, n=1, vocab_size=500, seed=3)
    requests = workload.requests(256)
    requests += [SimRequest(0.05, prompt(12, 7), 10, 0, 2)]            # a group of two (swapped when preempted)
    profile = CostProfile({16: [0.001, 0, 1e-4, 1e-6, 0], 64: [0.003, 0, 1e-4, 2e-6, 0]}, num_gpu_blocks=40,
                          block_size=4, num_cpu_blocks=40)
    options = dict(SMALL, scheduling_policy=policy, enable_prefix_caching=True)
    sim = simulate(requests, profile, noise=False, record_outputs=True, **options)
    config = engine_config(profile, EngineArgs(**options))
    engine_outputs = replay_on_the_engine(requests, config, profile, token_buckets(64))
    assert [decisions(o) for o in sim.outputs] == [decisions(o) for o in engine_outputs]
    assert sim.metrics["num_preemptions"] > 0                             # the pool is tight enough to matter
    assert sim.metrics["completed"] == 41


def test_a_thousand_requests_complete_with_their_exact_output_lengths():
    workload = Workload(num_requests=1000, request_rate=50.0, input_len="lognormal:200", output_len="lognormal:100",
                        seed=1)
    requests = workload.requests(2048)
    profile = CostProfile({16: [0.01, 0, 1e-4, 1e-6, 0], 512: [0.05, 0, 1e-4, 5e-6, 0]}, num_gpu_blocks=4000)
    result = simulate(requests, profile)
    assert result.metrics["completed"] == 1000
    assert result.metrics["total_output_tokens"] == sum(r.output_len for r in requests)
    assert [r["output_tokens"] for r in result.metrics["requests"]] == [r.output_len for r in requests]


def test_workload_arrivals_are_the_bench_tools():
    from jaxengine.bench.serve import arrival_gaps

    requests = Workload(num_requests=5, request_rate=2.0, seed=4).requests()
    gaps = arrival_gaps(5, 2.0, 1.0, 4)
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, *[sum(gaps[:i]) for i in range(1, 5)]])
    with pytest.raises(ValueError, match="length"):
        Workload(input_len="many")


def test_shared_prefixes_hit_the_prefix_cache():
    workload = Workload(num_requests=20, request_rate=100.0, input_len="16", output_len="4", shared_prefix_len=64,
                        vocab_size=1000)
    result = simulate(workload, constant_profile(STEP, num_gpu_blocks=400, block_size=16))
    hits = sum(t["num_prefix_hit_tokens"] for t in result.trace)
    assert hits == 19 * 64


def test_the_adapter_limit_is_simulated():
    """Twelve adapters over the requests: at most max_loras of them in any step, every request
    served; a limit of 2 stretches the run against a limit of 12."""
    workload = Workload(num_requests=60, request_rate=400.0, input_len="24", output_len="12", num_adapters=12)
    assert {r.adapter for r in workload.requests()} == set(range(1, 13))
    runs = {}
    for max_loras in (2, 12):
        result = simulate(workload, constant_profile(STEP, num_gpu_blocks=400, block_size=4), record_outputs=True,
                          enable_lora=True, max_loras=max_loras, **SMALL)
        per_step = [len({s.request.lora_digest for s in out.scheduled_seqs}) for out in result.outputs]
        assert max(per_step) == min(max_loras, SMALL["max_num_seqs"]) and result.metrics["completed"] == 60
        runs[max_loras] = result.metrics["duration_s"]
    assert runs[2] > runs[12]
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        simulate(workload, constant_profile(STEP, num_gpu_blocks=400, block_size=4), **SMALL)


def test_recorded_runs_replay(tmp_path):
    bench = {"mode": "serve", "requests": [
        {"ok": True, "start_s": 0.5, "prompt_tokens": 12, "output_tokens": 7},
        {"ok": False, "start_s": 0.6, "prompt_tokens": 12, "output_tokens": 0},
        {"ok": True, "start_s": 0.1, "prompt_tokens": 30, "output_tokens": 2}]}
    (tmp_path / "run.json").write_text(json.dumps(bench))
    replay = from_bench_result(tmp_path / "run.json")
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in replay] == [(0.1, 30, 2), (0.5, 12, 7)]
    (tmp_path / "trace.jsonl").write_text('{"arrival_s": 1, "prompt_len": 5, "output_len": 3, "priority": 2}\n'
                                          '{"arrival_s": 0, "prompt_token_ids": [4, 5], "output_len": 1, "n": 2}\n')
    trace = from_jsonl(tmp_path / "trace.jsonl")
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_len, r.priority, r.n) for r in trace] == [
        (0.0, 2, 1, 0, 2), (1.0, 5, 3, 2, 1)]
    result = simulate(trace, constant_profile(STEP, num_gpu_blocks=64, block_size=4), **SMALL)
    assert result.metrics["total_output_tokens"] == 2 + 3
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        from_jsonl(tmp_path / "bad.jsonl")


def test_a_request_that_can_never_run_is_reported_not_hung():
    requests = [SimRequest(0.0, prompt(300), 4), SimRequest(0.0, prompt(8), 2)]
    result = simulate(requests, constant_profile(STEP, num_gpu_blocks=64, block_size=4), **SMALL)
    bad, good = result.metrics["requests"]
    assert not bad["ok"] and "max_model_len" in bad["error"]
    assert good["ok"] and good["output_tokens"] == 2


def test_the_result_draws_the_bench_figures(tmp_path):
    workload = Workload(num_requests=30, request_rate=20.0, input_len="32", output_len="16")
    result = simulate(workload, constant_profile(STEP, num_gpu_blocks=200))
    names = sorted(p.name for p in result.plot(tmp_path))
    assert "serve_latency_cdf.png" in names and "serve_throughput_over_time.png" in names
    assert any("kv" in n for n in names)
    assert result.to_dict()["simulated"] is True
    row = result.summary()
    assert row["requests"] == 30 and math.isfinite(row["ttft_p99_ms"])


def test_speculation_is_simulated_with_its_acceptance_and_the_gate_switches_it_off_where_it_costs():
    """Batch 1 on a profile where a step of 8 tokens costs 1.5 x one of 1: speculation with a high
    acceptance shortens the run by the steps it saves; at batch 32, where drafts move the step
    to a bucket that costs 3 x, the gate keeps it off (within 3% of no speculation). The
    acceptance fitted to the run's own trace is the one it ran with."""
    from jaxengine.lab.simulate import fit_acceptance

    profile = CostProfile({1: [0.010, 0, 0, 0, 0], 2: [0.011, 0, 0, 0, 0], 4: [0.012, 0, 0, 0, 0],
                           8: [0.015, 0, 0, 0, 0], 32: [0.020, 0, 0, 0, 0], 64: [0.060, 0, 0, 0, 0],
                           128: [0.120, 0, 0, 0, 0]}, num_gpu_blocks=4000, noise=None)
    options = dict(block_size=16, max_num_batched_tokens=128, max_num_seqs=64, token_buckets=[1, 2, 4, 8, 32, 64, 128])
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    one = [SimRequest(0.0, prompt(8), 200)]
    off = simulate(one, profile, noise=False, **options)
    on = simulate(one, profile, noise=False, acceptance=0.8, speculative_config=spec, **options)
    assert on.metrics["total_output_tokens"] == off.metrics["total_output_tokens"] == 200
    assert on.metrics["duration_s"] < 0.5 * off.metrics["duration_s"]
    assert fit_acceptance(on.trace) == pytest.approx(0.8, abs=0.06)
    many = [SimRequest(0.0, prompt(8, 10 * i), 100) for i in range(32)]
    off = simulate(many, profile, noise=False, **options)
    on = simulate(many, profile, noise=False, acceptance=0.8, speculative_config=spec, **options)
    assert on.metrics["duration_s"] <= 1.03 * off.metrics["duration_s"]
    assert sum(t["speculation_gain"] == 1.0 for t in on.trace) > 0.8 * len(on.trace)
