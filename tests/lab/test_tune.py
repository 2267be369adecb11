"""The tuner finds the known optimum of a synthetic cost model; its outputs."""
import itertools
import math

import pytest

from jaxengine.costmodel.profile import CostProfile
from jaxengine.lab.simulate import goodput, simulate
from jaxengine.lab.tune import pareto_front, tune
from jaxengine.lab.workload import Workload

# Steps of up to 256 tokens take 10 ms; a step past 256 tokens falls off a cliff to 200 ms. Under
# an ITL SLO of 100 ms the best budget is therefore 256: the largest that never leaves the fast
# buckets, so every step is cheap and as full as it can be; and the most sequences per step.
CLIFF = CostProfile({16: [0.01, 0, 0, 0, 0], 256: [0.01, 0, 0, 0, 0], 512: [0.2, 0, 0, 0, 0], 2048: [0.2, 0, 0, 0, 0]},
                    num_gpu_blocks=4000)
WORKLOAD = Workload(num_requests=120, input_len="32", output_len="16")
SLOS = {"itl_ms": 100}
SPACE = {"max_num_batched_tokens": [64, 128, 256, 512, 1024], "max_num_seqs": [16, 32, 64]}


def test_the_tuner_finds_the_known_optimum_of_the_cliff():
    result = tune(WORKLOAD, CLIFF, SLOS, space=SPACE, progress=False)
    assert (result.best.options["max_num_batched_tokens"], result.best.options["max_num_seqs"]) == (256, 64)
    brute = {(b, s): goodput(simulate(WORKLOAD, CLIFF, slos=SLOS, max_num_batched_tokens=b, max_num_seqs=s))
             for b, s in itertools.product(*SPACE.values())}
    assert result.best.goodput == max(brute.values())
    assert result.best.goodput > result.default.goodput          # the default budget (512) crosses the cliff
    assert result.default.options == {"max_num_batched_tokens": 512, "max_num_seqs": 64}
    assert result.flags == ["--max-num-batched-tokens", "256"]
    assert result.command == "python -m jaxengine.serve --max-num-batched-tokens 256"
    assert len(result.trials) < len(brute)                       # coordinate descent: not every pair tried


def test_invalid_settings_are_skipped_not_fatal():
    result = tune(WORKLOAD, CLIFF, SLOS, space={"max_num_batched_tokens": [16, 256], "max_num_seqs": [64]},
                  progress=False)
    bad = [t for t in result.trials if t.error]
    assert len(bad) == 1 and "max_num_batched_tokens" in bad[0].error and bad[0].goodput == -math.inf
    assert result.best.options["max_num_batched_tokens"] == 256


def test_the_frontier_is_what_no_trial_beats(tmp_path):
    result = tune(WORKLOAD, CLIFF, SLOS, space=SPACE, progress=False)
    front = pareto_front([t for t in result.trials if t.error is None])
    for t in front:
        assert not any(o.goodput > t.goodput and o.summary["ttft_p99_ms"] <= t.summary["ttft_p99_ms"]
                       for o in result.trials if o.error is None)
    assert result.plot_frontier(tmp_path / "f.png").stat().st_size > 1000
    assert result.table()[0]["goodput"] == result.best.goodput


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="slos"):
        tune(WORKLOAD, CLIFF, {}, progress=False)
    with pytest.raises(ValueError, match="not engine options"):
        tune(WORKLOAD, CLIFF, SLOS, space={"max_num_tokens": [1]}, progress=False)


def test_given_an_acceptance_the_tuner_decides_speculation():
    """Requests one at a time under a TPOT SLO that plain decoding (10 ms a token) misses and
    speculation at a high acceptance meets; at acceptance 0 speculation only costs and stays off."""
    from jaxengine.lab.tune import speculation_space
    from jaxengine.lab.workload import SimRequest

    profile = CostProfile({1: [0.010, 0, 0, 0, 0], 8: [0.012, 0, 0, 0, 0], 64: [0.05, 0, 0, 0, 0]},
                          num_gpu_blocks=4000, noise=None)
    requests = [SimRequest(2.0 * i, tuple(range(8 * i + 1, 8 * i + 9)), 64) for i in range(4)]
    space = {"speculative_config": speculation_space(4)}
    options = dict(max_num_batched_tokens=64, token_buckets=[1, 2, 4, 8, 16, 32, 64])
    high = tune(requests, profile, {"tpot_ms": 8}, space=space, base_options=options, progress=False, acceptance=0.9,
                noise=False)
    assert high.best.options["speculative_config"] is not None and high.best.goodput > high.default.goodput == 0
    none = tune(requests, profile, {"tpot_ms": 12}, space=space, base_options=options, progress=False, acceptance=0.0,
                noise=False)
    assert none.best.options["speculative_config"] is None
