"""Paged attention: the plain-jnp reference against dense numpy attention, and the tiled CPU
variant against the reference, on random ragged batches (decode-only, prefill-only, mixed,
chunks after a prefix hit, padding rows), GQA ratios 1/4/8, page sizes 4/16, window, soft cap and
attention sinks;
and the compiled CPU decode kernel against the jnp loop it replaces."""
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.kernels.paged_attention import paged_attention
from jaxengine.kernels.cpu_build import built_library
from jaxengine.kernels.paged_attention import cpu_decode
from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

from tests.kernels.batches import H, _sinks, dense, fp8_cache, make_batch, with_sinks

ROWS = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=6)


@settings(max_examples=20, deadline=None)
@given(rows=ROWS, kind=st.sampled_from(["mixed", "decode", "prefill"]), group=st.sampled_from([1, 4, 8]),
       page_size=st.sampled_from([4, 16]), seed=st.integers(0, 2**16), extras=st.sampled_from([{}, {"sliding_window": 5}, {"soft_cap": 3.0}, {"sinks": 2.0},
                              {"sinks": 2.0, "sliding_window": 5}]))
def test_reference_matches_dense_and_tiled_matches_reference(rows, kind, group, page_size, seed, extras):
    """Sinks: one learned logit per query head, a key of value zero (gpt-oss)."""
    if kind == "decode":
        rows = [(c, 1) for c, _ in rows]
    elif kind == "prefill":
        rows = [(0, n + 1) for _, n in rows]
    # One padded shape for every draw (padding tokens and rows too), so each (group, page size,
    # extras) compiles once: 6 rows of up to 41 + 20 tokens.
    pages_per_row = -(-61 // page_size)
    q, kc, vc, md, full = make_batch(np.random.default_rng(seed), rows, page_size, 2, group, 144, 8,
                                     num_pages=6 * pages_per_row + 1, max_blocks=pages_per_row + 1)
    scale = H ** -0.5
    extras = with_sinks(extras, 2 * group, seed)
    ref = np.asarray(paged_attention(q, kc, vc, md, scale=scale, **extras))
    tiled = np.asarray(jax.jit(lambda *a: paged_attention_tiled(*a, scale=scale, **extras))(q, kc, vc, md))
    real = sum(n for _, n in rows)
    expected = dense(q, rows, full, group, scale, extras.get("sliding_window"), extras.get("soft_cap"),
                     _sinks(extras))[:real]
    np.testing.assert_allclose(ref[:real], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tiled[:real], ref[:real], rtol=1e-5, atol=1e-5)
    assert np.isfinite(tiled).all() and np.isfinite(ref).all()


def test_bf16_inputs_stay_close_and_finite():
    q, kc, vc, md, full = make_batch(np.random.default_rng(0), [(9, 1), (0, 13), (20, 7)], 4, 2, 4, 32, 5)
    as_bf16 = [x.astype(jnp.bfloat16) for x in (q, kc, vc)]
    ref = np.asarray(paged_attention(q, kc, vc, md, scale=0.25))
    out = np.asarray(paged_attention_tiled(*as_bf16, md, scale=0.25)).astype(np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:21], ref[:21], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [
    [(c, 1) for c in (3, 70, 12, 0, 41, 95, 26, 58, 7)],                        # decodes of many lengths
    [(60, 1), (0, 37), (5, 1), (90, 1), (17, 20), (2, 1)],                        # prompts among decodes
], ids=["decode", "mixed"])
def test_tiles_grouped_by_length_match_the_reference(rows):
    """Groups of 2 tiles, longest first: each group stops at its own longest tile, and the
    tiles' outputs go back to their tokens."""
    q, kc, vc, md, full = make_batch(np.random.default_rng(3), rows, 4, 2, 4, 64, 10)
    ref = np.asarray(paged_attention(q, kc, vc, md, scale=0.25))
    out = np.asarray(jax.jit(lambda *a: paged_attention_tiled(*a, scale=0.25, group_size=2, decode_kernel=False))(
        q, kc, vc, md))
    real = sum(n for _, n in rows)
    np.testing.assert_allclose(out[:real], ref[:real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:real], dense(q, rows, full, 4, 0.25)[:real], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the CPU decode kernel")
def test_the_cpu_decode_kernel_builds_and_serves_f32_layers_only():
    q = jnp.zeros((4, 6, 64), jnp.float32)
    assert cpu_decode.available()
    assert cpu_decode.serves(q, jnp.zeros((8, 16, 2, 64), jnp.float32))
    assert not cpu_decode.serves(q, jnp.zeros((8, 16, 2, 64), jnp.bfloat16))
    assert not cpu_decode.serves(q, jnp.zeros((8, 128, 2, 64), jnp.float32))      # pages over 64 tokens


def test_a_failed_kernel_build_is_an_error_naming_the_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(subprocess.CalledProcessError, match="false"):
        built_library(cpu_decode.SOURCE)
    assert not list((tmp_path / "kernels").iterdir())              # no half-written library left


SHORT, LONG = (0, 3, 70, 12, 41, 95, 130), (0, 3, 700, 12, 410, 95, 130)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the CPU decode kernel")
@pytest.mark.parametrize("kv_heads, group, head_size, page_size, extras, contexts", [
    (3, 3, 64, 16, {}, SHORT),                             # the default model's layout
    (3, 3, 64, 16, {}, LONG),                              # over 1 MiB of keys and values: shared by the threads
    (2, 4, 12, 4, {"sliding_window": 7}, SHORT),           # a head size off the 8-float lanes
    (1, 8, 128, 16, {"soft_cap": 3.0}, SHORT),
    (4, 1, 32, 64, {}, SHORT),
    (2, 4, 64, 16, {"sinks": 2.0}, SHORT),
    (3, 3, 64, 16, {"sinks": 1.0, "sliding_window": 9}, LONG),
    (2, 8, 128, 16, {}, SHORT),                            # blocks of 8 prompt rows, heads of 8 vectors
    (1, 16, 16, 8, {"sliding_window": 20}, SHORT),         # blocks of 4 rows, heads of one vector
])
def test_the_cpu_decode_kernel_matches_the_jnp_loop(kv_heads, group, head_size, page_size, extras, contexts):
    """Decodes of many lengths beside a prompt chunk and padding rows: the kernel's outputs (every
    token's, the prompt chunk's too) equal the jnp loop's and the dense result; padding tokens stay zero. Short rows are
    read by the calling thread alone, long ones by the pool's threads too; the prompt chunk's 70
    tokens go in blocks of rows (the last block part-filled) where the CPU has AVX-512."""
    rows = [(c, 1) for c in contexts] + [(5, 70)]
    q, kc, vc, md, full = make_batch(np.random.default_rng(7), rows, page_size, kv_heads, group, 90, 10,
                                     head_size=head_size)
    scale = head_size ** -0.5
    extras = with_sinks(extras, kv_heads * group, 7)
    run = lambda flag: np.asarray(jax.jit(lambda *a: paged_attention_tiled(       # noqa: E731
        *a, scale=scale, decode_kernel=flag, **extras))(q, kc, vc, md))
    kernel, loop = run(True), run(False)
    real = sum(n for _, n in rows)
    expected = dense(q, rows, full, group, scale, extras.get("sliding_window"), extras.get("soft_cap"),
                     _sinks(extras))
    np.testing.assert_allclose(kernel[:real], loop[:real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kernel[:real], expected[:real], rtol=1e-5, atol=1e-5)
    assert not np.abs(kernel[real:]).any()


@settings(max_examples=5, deadline=None)
@given(rows=ROWS, seed=st.integers(0, 2**16), extras=st.sampled_from([{}, {"sliding_window": 5}, {"sinks": 2.0}]))
def test_an_fp8_cache_reads_as_the_values_it_holds_and_stays_near_the_f32_one(rows, seed, extras):
    # The per-tensor scales leave the kernel: K's joins the softmax scale, V's multiplies the output
    q, kc, vc, md, full = make_batch(np.random.default_rng(seed), rows, 16, 2, 4, 144, 8, num_pages=25, max_blocks=5)
    scale, k_scale, v_scale = H ** -0.5, 0.01, 0.012          # values of up to ~4.5 -> e4m3's range (448)
    extras = with_sinks(extras, 8, seed)
    k8, k_held = fp8_cache(kc, k_scale)
    v8, v_held = fp8_cache(vc, v_scale)
    real = sum(n for _, n in rows)
    held = np.asarray(paged_attention(q, k_held, v_held, md, scale=scale, **extras))[:real]
    ref = np.asarray(paged_attention(q, k8, v8, md, scale=scale * k_scale, **extras))[:real] * v_scale
    np.testing.assert_allclose(ref, held, rtol=1e-5, atol=1e-5)
    for kernel in (False, True):        # decode rows by the jnp loop, and by the CPU decode kernel (fp8 pages)
        tiled = np.asarray(jax.jit(lambda *a: paged_attention_tiled(*a, scale=scale * k_scale, decode_kernel=kernel,
                                                                    **extras))(q, k8, v8, md))
        np.testing.assert_allclose(tiled[:real] * v_scale, held, rtol=1e-5, atol=1e-5, err_msg=f"kernel {kernel}")
    f32 = np.asarray(paged_attention(q, kc, vc, md, scale=scale, **extras))[:real]
    # e4m3 keeps 3 mantissa bits: a value off by up to 1/16 of itself (one key: the output is its value)
    np.testing.assert_allclose(ref, f32, atol=0.3)
    assert np.abs(ref - f32).mean() < 0.03
