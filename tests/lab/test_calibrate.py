"""Calibration on a tiny model: every bucket measured, a fit that predicts its own steps, and a
profile the simulator runs on."""
import dataclasses
import math

import pytest

from jaxengine.lab.__main__ import main
from jaxengine.lab.calibrate import CalibrationGrid, calibrate
from jaxengine.costmodel.measure import _prefill_sizes
from jaxengine.costmodel.profile import load_profile
from jaxengine.lab.simulate import simulate
from jaxengine.lab.workload import Workload

ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, num_kv_blocks=128)


def test_prefill_sizes_fill_each_bucket_to_its_top_and_just_past_the_one_below():
    assert _prefill_sizes([16, 32, 64], rows=4) == [12, 28, 13, 60, 29]    # totals 16; 32, 17; 64, 33
    assert _prefill_sizes([16, 32], rows=16) == [16, 1]        # the decodes alone fill bucket 16


@pytest.fixture(scope="module")
def profile(chat_checkpoint):
    return calibrate(str(chat_checkpoint), grid=CalibrationGrid(contexts=(16, 96), rows=(1, 4), decode_steps=2),
                     progress=False, **ENGINE)


def test_calibration_measures_every_bucket(profile):
    assert sorted(profile.coefficients) == [1, 2, 4, 8, 16, 32, 64]
    assert all(c >= 0 for coef in profile.coefficients.values() for c in coef)
    assert profile.fit_error.num_steps >= 30
    e = profile.fit_error                                      # a tiny model's steps are host noise: no bound
    assert 0 <= e.p50_abs_pct <= e.p90_abs_pct <= e.max_abs_pct and math.isfinite(e.mean_abs_pct)
    assert (profile.num_gpu_blocks, profile.block_size, profile.max_model_len) == (128, 16, 256)
    assert profile.source["engine_options"]["max_num_batched_tokens"] == 64
    assert profile.source["num_steps"] == profile.fit_error.num_steps


def test_the_simulator_runs_on_a_calibrated_profile(profile):
    result = simulate(Workload(num_requests=50, request_rate=20.0, input_len="40", output_len="10", vocab_size=258),
                      profile, max_num_batched_tokens=64, max_num_seqs=8)
    assert result.metrics["completed"] == 50 and result.metrics["total_output_tokens"] == 500
    assert 0 < result.metrics["ttft_ms"]["median"] < 10_000


def test_rescale_restates_a_profile_at_this_machines_speed_now(profile, chat_checkpoint, tmp_path):
    """A profile ten times too slow comes back near this machine's level, measured on a small grid
    with the profile's own engine options."""
    slow = dataclasses.replace(profile, coefficients={b: [10 * c for c in v] for b, v in profile.coefficients.items()})
    main(["calibrate", "--profile", str(slow.save(tmp_path / "slow.json")), "--model", str(chat_checkpoint),
          "--contexts", "16", "--rows", "1,4", "--decode-steps", "2", "--no-progress",
          "--result-file", str(tmp_path / "now.json")])
    now = load_profile(tmp_path / "now.json")
    rescaled = now.source["rescaled"]
    assert rescaled["profile"] == str(tmp_path / "slow.json") and rescaled["num_steps"] >= 10
    assert 0.02 < rescaled["factor"] < 0.5                    # host noise of a tiny model: about 0.1
    assert now.coefficients[64] == pytest.approx([rescaled["factor"] * c for c in slow.coefficients[64]])
    assert (now.num_gpu_blocks, now.max_model_len) == (128, 256)


def test_a_mixture_of_experts_profile_holds_its_parameters_and_prices_its_routed_tokens(moe_chat_checkpoint):
    folder, hf = moe_chat_checkpoint
    moe = calibrate(str(folder), grid=CalibrationGrid(contexts=(16,), rows=(1, 4), decode_steps=2), progress=False,
                    **{**ENGINE, "max_num_batched_tokens": 16})
    assert moe.routed_pairs_per_token == 3 * 2                  # top 3 in each of 2 sparse layers
    assert moe.num_params == sum(p.numel() for p in hf.parameters()) > moe.num_active_params
    assert all(len(c) == 6 and min(c) >= 0 for c in moe.coefficients.values())
    assert math.isfinite(moe.fit_error.mean_abs_pct)
