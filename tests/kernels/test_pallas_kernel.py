"""The Pallas ragged paged-attention kernel (interpret mode on the CPU) against the plain-jnp
reference: decode-only, prefill-only and mixed batches, chunks after a prefix-cache hit, pages
crossed, 1-token and many-page contexts, GQA 1/4/8, page sizes 16/32, head sizes 64/128,
f32 and bf16, sliding window, soft cap, attention sinks, padding rows and tokens."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.kernels.paged_attention import paged_attention
from jaxengine.kernels.paged_attention.kernel import BlockSizes, block_sizes, paged_attention_pallas, validate
from tests.kernels.cuda_target import as_on_h100
from tests.kernels.batches import make_batch, with_sinks

DECODE = [(0, 1), (15, 1), (16, 1), (40, 1), (95, 1)]
PREFILL = [(0, 5), (0, 33), (0, 17)]
MIXED = [(30, 1), (0, 20), (16, 1), (48, 19), (7, 1)]       # (48, 19): a chunk after a prefix hit
CASES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED, "one-token": [(0, 1)], "many-pages": [(150, 3)]}


def run_both(rows, *, page_size=16, kv_heads=2, group=4, head_size=64, dtype=jnp.float32, extra_tokens=5,
             extra_rows=2, seed=0, kernel=paged_attention_pallas, kernel_kw=None, **kw):
    """The kernel (interpreted on the CPU, compiled on a GPU) and the reference on one random
    batch: (kernel's output, reference's, number of real tokens)."""
    rng = np.random.default_rng(seed)
    # Padded up to shared buckets, as the engine pads a step: the cases of one layout compile once.
    num_tokens = round_up(sum(n for _, n in rows) + extra_tokens, 64)
    pages = [-(-(c + n) // page_size) for c, n in rows]
    q, kc, vc, md, _ = make_batch(rng, rows, page_size, kv_heads, group, num_tokens,
                                  round_up(len(rows) + extra_rows, 8), head_size=head_size,
                                  num_pages=round_up(sum(pages) + 1, 16), max_blocks=round_up(max(pages) + 1, 16))
    q, kc, vc = q.astype(dtype), kc.astype(dtype), vc.astype(dtype)
    scale = head_size ** -0.5
    kw = with_sinks(kw, kv_heads * group, seed)
    want = paged_attention(q, kc, vc, md, scale=scale, **kw)
    got = kernel(q, kc, vc, md, scale=scale, **kw, **(kernel_kw or {}))
    return np.asarray(got, np.float32), np.asarray(want, np.float32), sum(n for _, n in rows)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def assert_close(got, want, real, rtol):
    assert not np.isnan(got).any()
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)
    assert (got[real:] == 0).all()                                     # padding tokens: zeros


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_matches_reference_f32(case, group):
    got, want, real = run_both(CASES[case], group=group)
    assert_close(got, want, real, 1e-5)


@pytest.mark.parametrize("page_size,head_size", [(32, 64), (16, 128), (32, 128)])
def test_page_and_head_sizes(page_size, head_size):
    got, want, real = run_both(MIXED, page_size=page_size, head_size=head_size, group=2)
    assert_close(got, want, real, 1e-5)


def test_bf16_within_2e_2():
    got, want, real = run_both(MIXED, dtype=jnp.bfloat16, group=4)
    assert_close(got, want, real, 2e-2)


@pytest.mark.parametrize("kw", [dict(sliding_window=7), dict(soft_cap=5.0), dict(sliding_window=20, soft_cap=2.0),
                                dict(sinks=2.0), dict(sinks=1.0, sliding_window=9)])
def test_sliding_window_and_soft_cap(kw):
    got, want, real = run_both(MIXED, group=4, **kw)
    assert_close(got, want, real, 1e-5)


def test_non_power_of_two_group_and_explicit_block_sizes():
    got, want, real = run_both(MIXED, group=3, kv_heads=3)                  # SmolLM2's layout: G = 3
    assert_close(got, want, real, 1e-5)
    rng = np.random.default_rng(1)
    q, kc, vc, md, _ = make_batch(rng, MIXED, 16, 2, 2, 60, 6, head_size=64)
    want = paged_attention(q, kc, vc, md, scale=0.125)
    for sizes in (BlockSizes(4, 1), BlockSizes(32, 8)):
        got = paged_attention_pallas(q, kc, vc, md, scale=0.125, sizes=sizes)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(jnp.abs(want).max()))


def test_block_size_table_keeps_16_rows_per_tile():
    for group_p in (1, 2, 4, 8, 16):
        sizes = block_sizes(128, 16, jnp.bfloat16, group_p)
        assert sizes.block_q * group_p >= 16 and sizes.block_q & (sizes.block_q - 1) == 0


def test_validation_names_the_problem():
    q = jnp.zeros((4, 8, 64))
    cache = jnp.zeros((4, 16, 2, 64))
    rng = np.random.default_rng(0)
    _, _, _, md, _ = make_batch(rng, [(0, 4)], 16, 2, 4, 4, 1, head_size=64)
    with pytest.raises(ValueError, match="query heads"):
        validate(jnp.zeros((4, 6, 64)), jnp.zeros((4, 16, 4, 64)), jnp.zeros((4, 16, 4, 64)), md)
    with pytest.raises(ValueError, match="page size must be a power of two"):
        validate(q, jnp.zeros((4, 12, 2, 64)), jnp.zeros((4, 12, 2, 64)), md)
    with pytest.raises(ValueError, match="head size"):
        validate(q, jnp.zeros((4, 16, 2, 32)), jnp.zeros((4, 16, 2, 32)), md)
    validate(q, cache, cache, md)


@pytest.mark.parametrize("dtype,kv_heads,group,head_size,page_size", [
    (jnp.bfloat16, 8, 4, 128, 16),        # Llama-3-8B's layout
    (jnp.float32, 3, 3, 64, 16),          # SmolLM2's
    (jnp.bfloat16, 2, 1, 64, 32),
    (jnp.bfloat16, 8, 8, 64, 16),         # gpt-oss's, with sinks
])
def test_kernel_lowers_to_triton_for_cuda(dtype, kv_heads, group, head_size, page_size):
    """Without a GPU: the Pallas -> Triton lowering accepts every op of the kernel (cross-platform
    lowering through jax.export; the GPU check compiles and runs it)."""
    import jax
    from jax import export

    rng = np.random.default_rng(0)
    q, kc, vc, md, _ = make_batch(rng, MIXED, page_size, kv_heads, group, 80, 6, head_size=head_size)
    sinks = with_sinks({"sinks": 1.0}, kv_heads * group, 0)["sinks"] if group == 8 else None
    fn = jax.jit(lambda q, kc, vc, md: paged_attention_pallas(q, kc, vc, md, scale=0.1, interpret=False,
                                                             sliding_window=9, soft_cap=3.0, sinks=sinks))
    from jax.experimental.pallas import triton as plgpu

    target = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")     # named from JAX 0.11
    args = q.astype(dtype), kc.astype(dtype), vc.astype(dtype), md      # computed here, not for the GPU
    with as_on_h100():
        exported = export.export(fn, platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
    assert target in exported.mlir_module()


def random_ragged_batch(rng) -> tuple[list[tuple[int, int]], dict]:
    """A random mix of decodes, whole prompts and chunks after a cached prefix, any lengths, page
    boundaries crossed anywhere; random GQA ratio, page size and padding: (rows, run_both's options)."""
    rows = []
    for _ in range(rng.integers(1, 7)):
        kind = rng.integers(3)
        context = 0 if kind == 1 else int(rng.integers(1, 90))
        rows.append((context, 1 if kind == 0 else int(rng.integers(2, 40))))
    return rows, dict(page_size=int(rng.choice([16, 32])), kv_heads=int(rng.choice([1, 2])),
                      group=int(rng.choice([1, 2, 3, 4, 8])), extra_tokens=int(rng.integers(0, 9)),
                      extra_rows=int(rng.integers(0, 3)))


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches(seed):
    rows, options = random_ragged_batch(np.random.default_rng(100 + seed))
    got, want, real = run_both(rows, seed=seed, **options)
    assert_close(got, want, real, 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_fp8_cache_reads_as_the_plain_jnp_path_reads_it(dtype):
    from tests.kernels.batches import fp8_cache

    rng = np.random.default_rng(3)
    q, kc, vc, md, _ = make_batch(rng, MIXED, 16, 2, 4, 64, 8, head_size=64, num_pages=16, max_blocks=16)
    (k8, _), (v8, _) = fp8_cache(kc, 0.01), fp8_cache(vc, 0.004)
    scale = 64 ** -0.5 * 0.01
    want = paged_attention(q.astype(dtype), k8, v8, md, scale=scale)
    got = paged_attention_pallas(q.astype(dtype), k8, v8, md, scale=scale)
    assert got.dtype == dtype
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), sum(n for _, n in MIXED),
                 1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_fp8_cache_stored_as_bytes_reads_as_its_float8_values(dtype):
    """The CPU stores an FP8 cache as its bytes (``layout``): the kernel views them as float8, so it
    gives exactly what it gives over the float8 cache, and the plain-jnp path's output over the bytes."""
    import jax

    from tests.kernels.batches import fp8_cache

    rng = np.random.default_rng(3)
    q, kc, vc, md, _ = make_batch(rng, MIXED, 16, 2, 4, 64, 8, head_size=64, num_pages=16, max_blocks=16)
    (k8, _), (v8, _) = fp8_cache(kc, 0.01), fp8_cache(vc, 0.004)
    k_bytes, v_bytes = (jax.lax.bitcast_convert_type(c, jnp.uint8) for c in (k8, v8))
    q, scale = q.astype(dtype), 64 ** -0.5 * 0.01
    got = paged_attention_pallas(q, k_bytes, v_bytes, md, scale=scale)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(paged_attention_pallas(q, k8, v8, md, scale=scale), np.float32))
    want = paged_attention(q, k_bytes, v_bytes, md, scale=scale)
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), sum(n for _, n in MIXED),
                 1e-5 if dtype == jnp.float32 else 2e-2)
