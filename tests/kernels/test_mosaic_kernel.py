"""The Hopper (Mosaic GPU) ragged paged-attention kernel against the plain-jnp reference, run by
Mosaic GPU's interpreter on the CPU with its race detector on (compiled on an sm_90 GPU):
decode-only, prefill-only and mixed batches, chunks after a prefix-cache hit, 1-token and
many-page contexts, GQA 1/3/4/8, pages 16/32/64, head sizes 64/128, bf16 and f16, FP8 caches, sliding
window, soft cap, attention sinks, ring depths, padding; its lowering for CUDA; the backend choice."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.kernels.paged_attention import mosaic_kernel, paged_attention
from jaxengine.kernels.paged_attention.backend import select_attention
from jaxengine.kernels.paged_attention.kernel import BlockSizes, paged_attention_pallas
from jaxengine.kernels.paged_attention.mosaic_kernel import paged_attention_mosaic, supports
from tests.kernels.mosaic_interpret import transposed_wgmma_operands
from tests.kernels.batches import make_batch, with_sinks
from tests.kernels.test_pallas_kernel import CASES, MIXED, assert_close, random_ragged_batch
from tests.kernels.test_pallas_kernel import run_both as run_both_kernels

ON_CPU = jax.devices()[0].platform == "cpu"
HOPPER = not ON_CPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
pytestmark = pytest.mark.skipif(not (ON_CPU or HOPPER), reason="the Mosaic GPU kernel runs on sm_90 or interpreted")


@pytest.fixture(autouse=True)
def race_checked_interpreter(monkeypatch):
    """Interpret with the happens-before race detector; fail on any race it reports."""
    if not ON_CPU:
        yield
        return
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    monkeypatch.setattr(mosaic_kernel, "_interpret_params", lambda: InterpretGPUParams(detect_races=True))
    with transposed_wgmma_operands():
        yield
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    if gpu_callbacks._races is None:      # nothing was interpreted in this process yet (a lowering-only test)
        return
    assert not interpreter.get_races().races_found


def run_both(rows, *, dtype=jnp.bfloat16, sizes=None, **kw):
    """test_pallas_kernel's comparison, with this kernel."""
    kernel = lowered_and_run if ON_CPU else paged_attention_mosaic
    return run_both_kernels(rows, dtype=dtype, kernel=kernel, kernel_kw=dict(sizes=sizes), **kw)


def lowered_and_run(*args, **kw):
    """On the CPU each case is also lowered for sm_90: the interpreter is lenient about operand
    shapes and shared memory."""
    lower_for_hopper(*args, **kw)
    return paged_attention_mosaic(*args, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_matches_reference(case, group):
    got, want, real = run_both(CASES[case], group=group)
    assert_close(got, want, real, 2e-2)


@pytest.mark.parametrize("page_size,head_size,dtype", [(32, 64, jnp.bfloat16), (16, 128, jnp.bfloat16),
                                                       (64, 128, jnp.float16), (32, 128, jnp.float16)])
def test_page_sizes_head_sizes_and_f16(page_size, head_size, dtype):
    got, want, real = run_both(MIXED, page_size=page_size, head_size=head_size, dtype=dtype, group=2)
    assert_close(got, want, real, 2e-2)


@pytest.mark.parametrize("kw", [dict(sliding_window=7), dict(soft_cap=5.0), dict(sliding_window=20, soft_cap=2.0),
                                dict(sinks=2.0, sliding_window=9), dict(sinks=1.0, group=3, kv_heads=3)])
def test_sliding_window_soft_cap_and_sinks(kw):
    got, want, real = run_both(MIXED, **{"group": 4, **kw})
    assert_close(got, want, real, 2e-2)


@pytest.mark.parametrize("sizes", [BlockSizes(64, 4, num_stages=3), BlockSizes(64, 8, num_stages=4),
                                   BlockSizes(64, 16, num_stages=2)])
def test_ring_depths_and_keys_per_step(sizes):
    """64 to 256 keys per step and rings of 2-4 slots, over contexts of up to 10 pages."""
    got, want, real = run_both([(150, 3), (0, 20), (70, 1), (33, 2)], group=3, kv_heads=3, sizes=sizes)
    assert_close(got, want, real, 2e-2)


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed):
    rows, options = random_ragged_batch(np.random.default_rng(200 + seed))
    got, want, real = run_both(rows, seed=seed, **options)
    assert_close(got, want, real, 2e-2)


@pytest.mark.parametrize("dtype,head_size,page_size", [(jnp.bfloat16, 64, 16), (jnp.float16, 128, 32)])
def test_an_fp8_cache_reads_as_the_plain_jnp_path_reads_it(dtype, head_size, page_size):
    """FP8 pages by TMA, converted to the queries' dtype in shared memory before each WGMMA."""
    from tests.kernels.batches import fp8_cache

    rng = np.random.default_rng(3)
    q, kc, vc, md, _ = make_batch(rng, MIXED, page_size, 2, 4, 64, 8, head_size=head_size, num_pages=16,
                                  max_blocks=16)
    (k8, _), (v8, _) = fp8_cache(kc, 0.01), fp8_cache(vc, 0.004)
    scale = head_size ** -0.5 * 0.01
    assert supports(q.astype(dtype), k8)
    want = paged_attention(q.astype(dtype), k8, v8, md, scale=scale, sliding_window=40)
    kernel = lowered_and_run if ON_CPU else paged_attention_mosaic
    got = kernel(q.astype(dtype), k8, v8, md, scale=scale, sliding_window=40)
    assert got.dtype == dtype
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), sum(n for _, n in MIXED), 2e-2)


def test_unsupported_layouts_are_refused_by_name():
    rng = np.random.default_rng(0)
    q, kc, vc, md, _ = make_batch(rng, MIXED, 16, 2, 4, 60, 6, head_size=64)
    with pytest.raises(ValueError, match="16-bit q"):
        paged_attention_mosaic(q, kc, vc, md, scale=0.1)                          # f32
    q, kc, vc = (a.astype(jnp.bfloat16) for a in (q, kc, vc))
    with pytest.raises(ValueError, match="keys per iteration"):
        paged_attention_mosaic(q, kc, vc, md, scale=0.1, sizes=BlockSizes(64, 32))    # 512 keys
    with pytest.raises(ValueError, match="keys per iteration"):
        paged_attention_mosaic(q, kc, vc, md, scale=0.1, sizes=BlockSizes(64, 2))     # 32 keys: under a swizzle
    with pytest.raises(ValueError, match="num_stages"):
        paged_attention_mosaic(q, kc, vc, md, scale=0.1, sizes=BlockSizes(64, 4, num_stages=1))
    q, kc, vc, md, _ = make_batch(rng, MIXED, 16, 2, 4, 60, 6, head_size=256)
    with pytest.raises(ValueError, match="shared memory"):                        # 3 x 256 keys of 256 lanes
        paged_attention_mosaic(*(a.astype(jnp.bfloat16) for a in (q, kc, vc)), md, scale=0.1,
                               sizes=BlockSizes(64, 16, num_stages=3))
    assert supports(q.astype(jnp.bfloat16), kc.astype(jnp.bfloat16)) and not supports(q, kc)
    assert not supports(jnp.zeros((4, 4, 32), jnp.bfloat16), jnp.zeros((4, 16, 1, 32), jnp.bfloat16))


def lower_for_hopper(q, kc, vc, md, **kw):
    """Pallas' Mosaic GPU lowering for sm_90 through jax.export (layout inference, TMA and WGMMA
    operand shapes, the shared-memory budget): what the interpreter does not check."""
    from jax import export

    fn = jax.jit(lambda q, kc, vc, md: paged_attention_mosaic(q, kc, vc, md, interpret=False, **kw))
    return export.export(fn, platforms=["cuda"])(q, kc, vc, md)


@pytest.mark.skipif(not ON_CPU, reason="the GPU compiles it for real")
@pytest.mark.parametrize("kv_heads,group,head_size,page_size,kw", [
    (8, 4, 128, 16, {}),                                  # Llama-3-8B's layout
    (3, 3, 64, 32, dict(sliding_window=9, soft_cap=3.0)),  # SmolLM2's, with a window and a cap
    (2, 1, 64, 64, {}),
    (8, 8, 64, 16, dict(sinks=1.0, sliding_window=128)),  # gpt-oss's: sinks, a window on every other layer
])
def test_kernel_lowers_for_hopper(kv_heads, group, head_size, page_size, kw):
    """Without a GPU: the layouts that matter lower for sm_90 (the GPU check compiles and runs them)."""
    rng = np.random.default_rng(0)
    q, kc, vc, md, _ = make_batch(rng, MIXED, page_size, kv_heads, group, 80, 6, head_size=head_size)
    kw = with_sinks(kw, kv_heads * group, 0)
    exported = lower_for_hopper(*(a.astype(jnp.bfloat16) for a in (q, kc, vc)), md, scale=0.1, **kw)
    assert "mosaic_gpu" in exported.mlir_module()


def test_backend_choice(monkeypatch):
    from jaxengine.kernels.paged_attention import backend
    from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

    cpu = jax.devices("cpu")[0]
    assert select_attention("auto", cpu) is paged_attention_tiled
    assert select_attention("cpu", cpu) is paged_attention_tiled
    reference = select_attention("reference", cpu)          # the plain-jnp path alone: no compiled kernel
    assert (reference.func, reference.keywords) == (paged_attention_tiled, {"decode_kernel": False})
    assert select_attention("pallas", cpu) is paged_attention_pallas
    assert select_attention("pallas-triton", cpu) is paged_attention_pallas
    assert select_attention("pallas-mosaic", cpu) is paged_attention_mosaic
    with pytest.raises(ValueError, match="attention_backend: must be one of"):
        select_attention("triton", cpu)

    class Gpu:
        platform = "gpu"

        def __init__(self, capability):
            self.compute_capability = capability

    assert select_attention("auto", Gpu("7.5")) is paged_attention_tiled          # below Triton's floor
    assert select_attention("auto", Gpu("8.0")) is paged_attention_pallas
    assert select_attention("auto", Gpu("9.0")) is paged_attention_pallas          # until measured faster
    monkeypatch.setattr(backend, "MOSAIC_ON_HOPPER", True)
    assert select_attention("auto", Gpu("8.9")) is paged_attention_pallas
    hopper = select_attention("auto", Gpu("9.0"))
    used = []
    monkeypatch.setattr(mosaic_kernel, "paged_attention_mosaic",
                        lambda *a, **kw: used.append("mosaic") or paged_attention_mosaic(*a, **kw))
    rng = np.random.default_rng(0)
    q, kc, vc, md, _ = make_batch(rng, MIXED, 16, 2, 4, 60, 6, head_size=64)
    want = np.asarray(paged_attention(q, kc, vc, md, scale=0.1))
    for dtype, kernel in ((jnp.float32, []), (jnp.bfloat16, ["mosaic"])):     # f32: the Triton kernel
        used.clear()
        got = hopper(*(a.astype(dtype) for a in (q, kc, vc)), md, scale=0.1)
        assert used == kernel and got.dtype == dtype
        assert_close(np.asarray(got, np.float32), want, sum(n for _, n in MIXED), 2e-2)
