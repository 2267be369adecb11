"""Cost profiles: the fit recovers known costs, interpolates between buckets, reads traces and
files."""
import json

import numpy as np
import pytest

from jaxengine.costmodel.profile import CostProfile, StepShape, load_profile, nonnegative_lstsq
from jaxengine.trace import StepTrace

TRUE = {16: [0.002, 0.003, 0.0001, 1e-6, 0.0, 0.0], 64: [0.004, 0.0, 0.0001, 4e-6, 0.0, 0.0]}


def shapes_for(bucket, rng):
    return [StepShape(int(t), int(r), int(m), int(m) * int(r), num_prefill_tokens=int(t) * int(p))
            for t, r, m, p in zip(rng.integers(1, bucket + 1, 40), rng.integers(1, 16, 40), rng.integers(16, 1024, 40),
                                  rng.integers(0, 2, 40))]


def true_seconds(shape, bucket):
    return float(np.dot(TRUE[bucket], shape.features()))


def test_fit_recovers_the_coefficients_of_each_bucket():
    rng = np.random.default_rng(0)
    shapes, buckets = [], []
    for b in TRUE:
        s = shapes_for(b, rng)
        shapes += s
        buckets += [b] * len(s)
    seconds = [true_seconds(s, b) for s, b in zip(shapes, buckets)]
    profile = CostProfile.fit(shapes, buckets, seconds, num_gpu_blocks=100)
    for b, coef in TRUE.items():
        np.testing.assert_allclose(profile.coefficients[b], coef, rtol=1e-6, atol=1e-12)
    assert profile.fit_error.num_steps == 80
    assert profile.fit_error.max_abs_pct < 1e-6
    assert profile.noise[0] == pytest.approx(1.0) and profile.noise[-1] == pytest.approx(1.0)


def test_a_mixture_of_experts_fit_prices_its_routed_tokens_apart_from_the_padding():
    # within a bucket a dense step costs the same whatever its real tokens; experts run on real ones
    rng = np.random.default_rng(1)
    moe = {16: [0.002, 0.0, 0.0001, 1e-6, 0.0, 2e-5]}
    shapes = shapes_for(16, rng)
    seconds = [float(np.dot(moe[16], s.features(6))) for s in shapes]
    profile = CostProfile.fit(shapes, [16] * len(shapes), seconds, num_gpu_blocks=100, routed_pairs_per_token=6)
    np.testing.assert_allclose(profile.coefficients[16], moe[16], rtol=1e-6, atol=1e-12)
    few, many = StepShape(2, 2, 100, 200), StepShape(16, 2, 100, 200)
    assert profile.step_seconds(many, 16) - profile.step_seconds(few, 16) == pytest.approx(14 * 6 * 2e-5)


def test_scaled_to_restates_the_level_and_keeps_the_spread():
    profile = CostProfile(TRUE, num_gpu_blocks=100, noise=[0.8, 1.0, 1.3])
    decode, prefill = StepShape(4, 4, 300, 1200), StepShape(60, 4, 300, 1200, num_prefill_tokens=56)
    shapes, buckets = [decode, decode, prefill], [16, 16, 64]
    seconds = [0.5 * true_seconds(decode, 16), 0.6 * true_seconds(decode, 16), 0.9 * true_seconds(prefill, 64)]
    scaled = profile.scaled_to(shapes, buckets, seconds, "rescaled")
    assert scaled.source["rescaled"] == {"factor": pytest.approx(0.6), "num_steps": 3,
                                         "median_ratio": {"prefill": pytest.approx(0.9), "decode": pytest.approx(0.55)}}
    assert scaled.coefficients[64] == pytest.approx([0.6 * c for c in TRUE[64]])
    assert scaled.noise == [0.8, 1.0, 1.3] and profile.source == {}
    assert scaled.fit_error.max_abs_pct == pytest.approx(100 / 3)     # |0.6 - 0.9| / 0.9
    assert profile.scaled_to(shapes, buckets, seconds, "x", spread=True).noise[0] == pytest.approx(0.5 / 0.6)
    with pytest.raises(ValueError, match="no steps"):
        profile.scaled_to([], [], [], "rescaled")


def test_an_unmeasured_bucket_interpolates_linearly_in_its_size():
    profile = CostProfile({16: [0.002, 0, 0, 0, 0], 64: [0.008, 0, 0, 0, 0]}, num_gpu_blocks=10)
    shape = StepShape(20, 1, 10, 10)
    assert profile.step_seconds(shape, 32) == pytest.approx(0.002 + (32 - 16) / 48 * 0.006)
    assert profile.step_seconds(shape, 128) == pytest.approx(0.008 + 64 / 48 * 0.006)   # extrapolated


def test_nonnegative_lstsq_never_returns_a_negative_cost():
    x = np.array([[1, 1.0], [1, 2.0], [1, 3.0]])
    y = np.array([3.0, 2.0, 1.0])                      # falls with the feature: best fit has a negative slope
    coef = nonnegative_lstsq(x, y)
    assert (coef >= 0).all()
    np.testing.assert_allclose(coef, [2.0, 0.0])


def test_noise_ratio_interpolates_the_quantiles():
    profile = CostProfile({16: [0.01, 0, 0, 0, 0]}, num_gpu_blocks=10, noise=[0.5, 1.0, 2.0])
    assert profile.noise_ratio(0.0) == 0.5
    assert profile.noise_ratio(0.25) == pytest.approx(0.75)
    assert profile.noise_ratio(1.0) == 2.0


ROWS = list(range(1, 17))         # every row count its own bucket (from 8 tokens, from 8 rows)


def trace(step, prefill, decode, rows, max_ctx, sum_ctx, step_s):
    return StepTrace(step, 0.0, rows, decode, prefill, 0, 0, 0, 0, 0.0, 0, 0, rows, 0, step_s, step_s, 0.0,
                     max_ctx, sum_ctx)


def test_from_trace_fits_the_recorded_steps_and_skips_the_first():
    records = [trace(0, 16, 0, 1, 16, 16, 9.0)]          # a compile: left out
    records += [trace(i, 10, r, r + 1, 100 + i, 200, 0.001 * (r + 1) + 0.01) for i, r in enumerate(range(8, 13), 1)]
    profile = CostProfile.from_trace(records, [16, 32], ROWS, num_gpu_blocks=50)
    assert profile.fit_error.num_steps == 5
    assert profile.step_seconds(StepShape(30, 12, 103, 200), 32) == pytest.approx(0.022)
    padded, bucket = StepShape(3, 3, 103, 200).bucketed([4, 16, 32], [2, 4, 8])
    assert bucket == 4 and padded.row_bucket == 4 and padded.features() == (1.0, 0.0, 4, 103, 200, 0.0)
    padded, bucket = StepShape(14, 3, 103, 200).bucketed([4, 16, 32], [2, 4, 8])
    assert bucket == 16 and padded.row_bucket == 8          # 16 tokens pad their rows to at least 8
    dicts = [vars(r) for r in records]
    assert CostProfile.from_trace(dicts, [16, 32], ROWS, num_gpu_blocks=50).coefficients == profile.coefficients


def test_a_trace_without_context_fields_is_refused():
    old = {**vars(trace(1, 4, 0, 1, 0, 0, 0.01))}
    del old["max_context_len"], old["num_context_tokens"]
    with pytest.raises(ValueError, match="max_context_len"):
        CostProfile.from_trace([old, old], [16], ROWS, num_gpu_blocks=50)


def test_save_and_load_give_the_same_predictions(tmp_path):
    profile = CostProfile({16: [0.002, 0, 0.0001, 1e-6, 0], 32: [0.003, 0, 0.0001, 2e-6, 0]}, num_gpu_blocks=77,
                          block_size=8, noise=[0.9, 1.0, 1.2], source={"model": "m"}, group_windows=(None, 128))
    path = profile.save(tmp_path / "p.json")
    loaded = load_profile(path)
    shape = StepShape(20, 3, 300, 600)
    assert loaded.step_seconds(shape, 32) == profile.step_seconds(shape, 32)
    assert (loaded.num_gpu_blocks, loaded.block_size, loaded.noise, loaded.source) == (77, 8, [0.9, 1.0, 1.2],
                                                                                      {"model": "m"})
    from jaxengine.engine_args import EngineArgs
    from jaxengine.lab.simulate import engine_config

    assert engine_config(loaded, EngineArgs(block_size=8)).cache.group_windows == (None, 128)   # the lab's pool slides
    earlier = json.loads(path.read_text())         # a file of the five features before routed_pairs
    earlier["features"] = earlier["features"][:5]
    earlier["coefficients"] = {b: c[:5] for b, c in earlier["coefficients"].items()}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    assert load_profile(tmp_path / "earlier.json").step_seconds(shape, 32) == profile.step_seconds(shape, 32)
    bad = json.loads(path.read_text())
    bad["features"] = ["const", "tokens"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="features"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
