"""The autopilot on a fake runner whose step time follows a known cost model (the simulator's
runner on a simulated clock, no noise): every figure below is worked out from that model."""
import math

import pytest

from jaxengine.autopilot import attach_autopilot
from jaxengine.autopilot.cost import CORRECTION_WINDOW
from jaxengine.engine import Engine
from jaxengine.engine_args import EngineArgs
from jaxengine.lab import CostProfile, Workload, simulate
from jaxengine.lab.simulate import SimClock, SimRunner, engine_config
from jaxengine.buckets import token_buckets
from jaxengine.testing.fake_runner import HashRunner
from jaxengine.sampling_params import SamplingParams

ITL_MS = 60


def linear_profile(scale: float = 1.0) -> CostProfile:
    """A step padded to bucket b takes scale x (10 ms + 0.2 ms x b), 2 ms more when it runs prompt
    tokens. Within 60 ms: bucket 128 (37.6 ms); bucket 256 takes 63.2 ms, the default 512 115 ms."""
    return CostProfile({b: [scale * (0.01 + 0.0002 * b), scale * 0.002, 0, 0, 0, 0] for b in token_buckets(512)},
                       num_gpu_blocks=4096)


def engine_on(profile: CostProfile, runner_profile: CostProfile | None = None, **options):
    args = EngineArgs(**{"max_model_len": 4096, **options})
    clock = SimClock()
    runner = SimRunner(runner_profile or profile, *args.step_buckets(), clock, noise=False)
    engine = Engine(engine_config(profile, args), runner, clock=clock, timer=clock, trace=True)
    attach_autopilot(engine, profile)
    return engine, runner


def decoding_engine(runner_profile=None, num_decodes=8, **options):
    """``num_decodes`` requests past their prompts, decoding for a long while."""
    engine, runner = engine_on(linear_profile(), runner_profile, **{"slo_itl_ms": ITL_MS, **options})
    for i in range(num_decodes):
        engine.add_request(f"d{i}", list(range(1, 17)), SamplingParams(max_tokens=400, ignore_eos=True))
    engine.step()
    return engine, runner


def crowded_engine(itl_ms: float, *, prompt_len: int, max_tokens: int, steps: int) -> Engine:
    """40 requests at once under an ITL target, after ``steps`` steps."""
    engine, _ = engine_on(linear_profile(), slo_itl_ms=itl_ms)
    for i in range(40):
        engine.add_request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True))
    for _ in range(steps):
        engine.step()
    return engine


def test_the_budget_is_the_largest_bucket_within_the_itl_target_while_a_long_prompt_advances():
    engine, _ = decoding_engine()
    assert engine.last_trace.autopilot_budget == 512          # nothing decoded yet: prompts go at full speed
    long = engine.add_request("long", list(range(1, 3001)), SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in range(100):
        if long.times.first_token is not None:
            break
        engine.step()
    mixed = [t for t in engine.traces if t.num_decode_tokens and t.num_prefill_tokens]
    assert len(mixed) == math.ceil(3000 / (128 - 8))            # 120 prompt tokens beside the 8 decodes
    assert {t.autopilot_budget for t in mixed} == {128}
    assert max(t.step_s for t in mixed) == pytest.approx(0.0376)          # < 60 ms
    assert all(t.predicted_step_s == pytest.approx(t.step_s) for t in mixed)      # the model is the truth here
    # Without the autopilot the default budget runs those steps at 115 ms.
    plain, _ = engine_on(linear_profile())
    plain.planner = None
    for i in range(8):
        plain.add_request(f"d{i}", list(range(1, 17)), SamplingParams(max_tokens=400, ignore_eos=True))
    plain.step()
    plain.add_request("long", list(range(1, 3001)), SamplingParams(max_tokens=1, ignore_eos=True))
    plain.step()
    assert plain.last_trace.step_s == pytest.approx(0.1144)


def test_a_hidden_slowdown_is_learnt_within_the_correction_window():
    slow = linear_profile()
    engine, runner = decoding_engine(runner_profile=slow)
    engine.add_request("long", list(range(1, 2001)), SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in range(5):
        engine.step()
    runner.profile = linear_profile(scale=2.0)        # the machine slows 2x; the autopilot is not told
    first_slow = engine.num_steps
    for _ in range(CORRECTION_WINDOW):
        engine.step()
    traces = engine.traces[first_slow:]
    adapted = CORRECTION_WINDOW // 2 + 1              # the median of the window is then the new ratio
    assert traces[adapted].cost_correction == 2.0
    late = traces[adapted:]
    assert {t.autopilot_budget for t in late} == {64}                 # 2 x (12 ms + 12.8 ms) = 49.6 ms
    assert max(t.step_s for t in late) == pytest.approx(0.0496)           # < 60 ms
    assert all(t.predicted_step_s == pytest.approx(t.step_s) for t in late[1:])
    assert sum(t.step_s > ITL_MS / 1000 for t in traces) <= adapted   # misses only while it learns


def test_a_request_with_a_tighter_itl_target_shrinks_the_budget_while_it_runs():
    from jaxengine.request import LatencyTargets

    engine, _ = decoding_engine()
    engine.add_request("tight", list(range(1, 9)), SamplingParams(max_tokens=3, ignore_eos=True),
                       slo=LatencyTargets(itl_s=0.03))
    engine.add_request("long", list(range(1, 2001)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()                                      # admits both
    engine.step()
    assert engine.last_trace.autopilot_budget == 64    # 30 ms: bucket 64 (24.8 ms), not 128 (37.6 ms)
    for _ in range(3):
        engine.step()                                  # "tight" finishes
    assert engine.last_trace.autopilot_budget == 128


def test_the_admission_limit_keeps_the_decode_step_within_target():
    # Decodes alone: 8 rows pad to bucket 8 (11.6 ms), 64 rows to 64 (22.8 ms); a 15 ms target
    # admits up to 16 sequences (13.2 ms), never preempting those already running.
    engine = crowded_engine(15, prompt_len=8, max_tokens=30, steps=6)
    assert engine.last_trace.autopilot_max_num_seqs == 16
    assert max(t.num_running for t in engine.traces) == 16
    engine.run()
    assert all(t.num_running <= 16 for t in engine.traces)


def test_a_long_prompt_shares_the_budget_when_it_still_meets_its_ttft_target():
    engine, _ = decoding_engine(slo_ttft_ms=5000)
    engine.add_request("long", list(range(1, 3001)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    shorts = [engine.add_request(f"s{i}", list(range(100 + i, 160 + i)), SamplingParams(max_tokens=1, ignore_eos=True))
              for i in range(3)]
    engine.step()
    t = engine.last_trace
    assert (t.autopilot_partial_prefills, t.autopilot_prefill_chunk) == (4, 30)     # 120 prompt tokens 4 ways
    for _ in range(3):
        engine.step()
    assert all(s.times.first_token is not None for s in shorts)      # 60 tokens at 30 a step: 2 steps
    # With a target the long prompt meets alone (24 steps, 0.9 s) but not sharing 2 ways (48
    # steps, 1.8 s), it keeps the whole prompt budget.
    strict, _ = decoding_engine(slo_ttft_ms=1200)
    strict.add_request("long", list(range(1, 3001)), SamplingParams(max_tokens=1, ignore_eos=True))
    strict.step()
    for i in range(3):
        strict.add_request(f"s{i}", list(range(100 + i, 160 + i)), SamplingParams(max_tokens=1, ignore_eos=True))
    strict.step()
    assert (strict.last_trace.autopilot_partial_prefills, strict.last_trace.autopilot_prefill_chunk) == (0, 0)


BURST = Workload(num_requests=60, input_len="512", output_len="32", seed=3)      # all at t = 0


def test_overload_turns_away_new_requests_only_and_serves_the_rest_in_full():
    slos = {"ttft_ms": 2000, "itl_ms": ITL_MS}
    shed = simulate(BURST, linear_profile(), slos=slos, noise=False, slo_ttft_ms=2000, slo_itl_ms=ITL_MS)
    queued = simulate(BURST, linear_profile(), slos=slos, noise=False, slo_ttft_ms=2000, slo_itl_ms=ITL_MS,
                      overload_policy="queue")
    # Prompts beside a decode go at the budget the ITL target allows (128: 127 prompt tokens per
    # 37.6 ms step); the k-th request (from 0) is predicted (k + 1) x 512 / 3378 s + 37.6 ms, over
    # the margin (2.5 s) from k = 16 on: the first 16 are served, the 44 after them turned away.
    errors = [r["error"] for r in shed.metrics["requests"]]
    assert errors == [None] * 16 + ["overloaded"] * 44
    served = shed.metrics["requests"][:16]
    assert all(r["output_tokens"] == 32 for r in served)             # no admitted request is cut short
    assert max(r["ttft_ms"] for r in served) == pytest.approx(2508.0)    # the prediction's error: 2%
    assert queued.metrics["failed"] == 0
    assert queued.metrics["ttft_ms"]["p99"] > 2000                    # queueing everything: later ones all late
    # The same 12 meet the target either way; turned away at once, the others no longer hold the
    # engine for 10 s: goodput (requests within target per second) is 3.5x.
    good = [round(r.metrics["goodput"] * r.metrics["duration_s"]) for r in (shed, queued)]
    assert good == [12, 12] and shed.metrics["goodput"] > 3 * queued.metrics["goodput"]


def test_nothing_is_turned_away_by_an_idle_engine_or_without_a_ttft_target():
    engine, _ = engine_on(linear_profile(), slo_ttft_ms=1)
    assert engine.overload_retry_after(list(range(1, 5000))) is None     # nothing ahead of it
    assert engine.overload_retry_after(list(range(1, 5000))) is not None  # now the first one is ahead
    itl_only, _ = engine_on(linear_profile(), slo_itl_ms=ITL_MS)
    assert all(itl_only.overload_retry_after(list(range(1, 5000))) is None for _ in range(3))


class TimedHashRunner(HashRunner):
    """The paged-cache-simulating runner, its steps timed by the same cost model on a clock."""

    def __init__(self, sim_runner: SimRunner, num_gpu_blocks: int, block_size: int) -> None:
        super().__init__(num_gpu_blocks, 0, block_size)
        self.sim = sim_runner

    def execute(self, out):
        self.sim.clock.now += self.sim.step_seconds(out)
        return super().execute(out)


def test_the_simulator_and_a_live_engine_make_the_same_decisions():
    options = dict(slo_ttft_ms=1500, slo_itl_ms=ITL_MS)
    workload = Workload(num_requests=40, request_rate=8, input_len="32:900", output_len="8:64", seed=5)
    sim = simulate(workload, linear_profile(), noise=False, **options)
    args = EngineArgs(**options)
    config = engine_config(linear_profile(), args)          # max_model_len: the profile's, as simulate's
    clock = SimClock()
    runner = TimedHashRunner(SimRunner(linear_profile(), *args.step_buckets(), clock, noise=False),
                             config.cache.num_gpu_blocks, config.cache.block_size)
    engine = Engine(config, runner, clock=clock, timer=clock, trace=True)
    attach_autopilot(engine, linear_profile())
    pending = sorted(enumerate(workload.requests()), key=lambda x: x[1].arrival_s)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_s <= clock.now:
            i, r = pending.pop(0)
            if engine.overload_retry_after(r.prompt_token_ids) is None:
                engine.add_request(str(i), list(r.prompt_token_ids), SamplingParams(max_tokens=r.output_len,
                                   ignore_eos=True), arrival_time=r.arrival_s)
        if not engine.has_unfinished_requests():
            clock.now = pending[0][1].arrival_s
            continue
        engine.step()
    fields = ("autopilot_budget", "autopilot_max_num_seqs", "autopilot_prefill_chunk", "autopilot_partial_prefills",
              "num_prefill_tokens", "num_decode_tokens")
    live = [tuple(getattr(t, f) for f in fields) for t in engine.traces]
    simulated = [tuple(t[f] for f in fields) for t in sim.trace]
    assert live == simulated and len({row[0] for row in live}) > 1


def test_a_target_no_step_can_meet_holds_nothing_back():
    # 5 ms: a step takes at least 10 ms, so neither a smaller budget nor fewer sequences helps.
    engine = crowded_engine(5, prompt_len=64, max_tokens=20, steps=4)
    t = engine.last_trace
    assert (t.autopilot_budget, t.autopilot_max_num_seqs) == (512, 64) and t.num_running == 40


def test_drafts_are_priced_into_the_budget():
    # 8 decodes drafting up to 4 tokens each: 40 tokens pad to bucket 64 (22.8 ms); within 20 ms
    # the budget is 32 (16.4 ms), so the drafts get what the 8 decodes leave of it.
    engine, _ = engine_on(linear_profile(), slo_itl_ms=20,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    for i in range(8):
        engine.add_request(f"d{i}", [7] * 16, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(6):
        engine.step()
    drafted = [t for t in engine.traces if t.num_draft_tokens]
    assert drafted and {t.autopilot_budget for t in drafted} == {32}
    assert max(t.num_decode_tokens + t.num_draft_tokens for t in drafted) <= 32
    assert max(t.step_s for t in engine.traces[1:]) <= 0.0164 + 1e-9            # within 20 ms


def test_a_prompt_budget_too_small_to_share_is_not_shared():
    # 14 decodes: the budget's first bucket above them is 16 (15.2 ms, over a 15 ms target, but the
    # floor), which leaves 2 prompt tokens: too few to share 4 ways, so the long prompt keeps them.
    engine, _ = decoding_engine(num_decodes=14, slo_ttft_ms=60000, slo_itl_ms=15)
    engine.add_request("long", list(range(1, 1001)), SamplingParams(max_tokens=1, ignore_eos=True))
    for i in range(4):
        engine.add_request(f"s{i}", list(range(200 + i, 210 + i)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    t = engine.last_trace
    assert (t.autopilot_budget, t.num_decode_tokens + t.num_prefill_tokens, t.num_rows) == (16, 16, 16)
    assert (t.autopilot_partial_prefills, t.autopilot_prefill_chunk) == (2, 1)     # 2 ways of 1 token
