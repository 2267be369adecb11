"""The Pallas KV write (interpret mode on the CPU) against the XLA scatter it may replace: every
slot written, nothing else touched, any token count, head counts that are not powers of two,
the caches donated; its Triton lowering for CUDA; clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas
from jaxengine.kernels.paged_attention.reference import write_kv
from tests.kernels.cuda_target import as_on_h100


def batch(num_tokens, kv_heads=3, head_size=64, pages=9, page_size=16, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    shape = (pages, page_size, kv_heads, head_size)
    k_cache = jnp.asarray(rng.normal(size=shape), dtype)
    v_cache = jnp.asarray(rng.normal(size=shape), dtype)
    k = jnp.asarray(rng.normal(size=(num_tokens, kv_heads, head_size)), jnp.float32)
    slots = rng.permutation(np.arange(page_size, pages * page_size))[:num_tokens]    # never the null block
    return k_cache, v_cache, k, -k, jnp.asarray(slots, jnp.int32)


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_writes_what_the_scatter_writes(num_tokens, dtype):
    k_cache, v_cache, k, v, slots = batch(num_tokens, dtype=dtype)
    want = write_kv(k_cache, v_cache, k, v, slots)
    got = jax.jit(write_kv_pallas, donate_argnums=(0, 1))(k_cache + 0, v_cache + 0, k, v, slots)
    for g, w, old in zip(got, want, (k_cache, v_cache)):
        g, w, old = (np.asarray(x, np.float32) for x in (g, w, old))
        np.testing.assert_array_equal(g[1:], w[1:])                  # the null block takes the padding rows
        changed = (g != old)[1:].any(axis=(2, 3)).reshape(-1)               # outside the null block
        assert set(np.flatnonzero(changed) + old.shape[1]) == set(np.asarray(slots).tolist())


def test_block_sizes_and_padding_slots():
    k_cache, v_cache, k, v, slots = batch(20, kv_heads=2, head_size=128, page_size=32)
    slots = slots.at[-4:].set(0)                                   # padding tokens: the null block's slot 0
    want = write_kv(k_cache, v_cache, k, v, slots)
    for block_tokens in (1, 8, 32):
        got = write_kv_pallas(k_cache, v_cache, k, v, slots, block_tokens=block_tokens)
        np.testing.assert_array_equal(np.asarray(got[0])[1:], np.asarray(want[0])[1:])
        np.testing.assert_array_equal(np.asarray(got[1])[1:], np.asarray(want[1])[1:])


def test_errors_name_the_problem():
    k_cache, v_cache, k, v, slots = batch(4)
    with pytest.raises(ValueError, match="expected k, v"):
        write_kv_pallas(k_cache, v_cache, k[:, :2], v[:, :2], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_pallas(k_cache, v_cache, k, v, slots[:3])
    with pytest.raises(ValueError, match="powers of two"):
        write_kv_pallas(k_cache, v_cache, k, v, slots, block_tokens=12)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the GPU compiles it for real")
def test_lowers_to_triton_for_cuda():
    from jax import export
    from jax.experimental.pallas import triton as plgpu

    k_cache, v_cache, k, v, slots = batch(24)
    target = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    fn = jax.jit(lambda *a: write_kv_pallas(*a, interpret=False), donate_argnums=(0, 1))
    with as_on_h100():
        exported = export.export(fn, platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(
            k_cache, v_cache, k, v, slots)
    assert target in exported.mlir_module()
