"""Ragged paged attention for Hopper (sm_90) with Pallas' Mosaic GPU backend: TMA page copies
into a ring of shared-memory buffers and WGMMA for both matmuls.

Same contract, query tiling and output layout as the Triton-lowered kernel (``kernel.py``); what
differs is how a program gets its data. One warpgroup per program (grid: query tile x KV head)
holds a 64-row query tile (``block_q`` tokens x the padded group of query heads) in shared memory.
Each iteration covers ``pages_per_block`` pages: their K and V head slices arrive by one TMA copy
per page on a barrier that expects one arrival per page, ``num_stages - 1`` iterations ahead of
the one in the matrix units, so the copy engine streams the cache and the SM only does arithmetic.
The queries are gathered tile-major first, so every TMA copy starts on a 64-row boundary. Scores
and the online softmax stay in registers in f32 (WGMMA accumulator layout); P is cast to the
cache dtype for the second WGMMA. 16-bit queries only (WGMMA takes f32 only as TF32); f32 caches
use the Triton kernel. An FP8 (float8_e4m3fn) cache arrives by TMA as stored, half the bytes of a
16-bit one; each step converts its K and V tiles to the queries' dtype into one staging tile in
shared memory, which the WGMMAs read. The cache's per-tensor scales are applied outside, as for
the Triton kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxengine.kernels.paged_attention.kernel import BlockSizes, prepare_tiles, gather_tile_outputs, validate
from jaxengine.kernels.paged_attention.layout import heads_apart, num_kv_heads as num_kv_heads_of
from jaxengine.kernels.paged_attention.metadata import AttentionMetadata

ROWS = 64                     # WGMMA's M for one warpgroup
SWIZZLE = 128                 # bytes: a 64-element bf16 row, the widest TMA/WGMMA swizzle
DTYPES = ("bfloat16", "float16")
SMEM_BYTES = 227 * 1024      # shared memory one Hopper block may take
FP8 = jnp.dtype(jnp.float8_e4m3fn)

# By (head size, page size, dtype): pages_per_block (keys per iteration = pages_per_block * page
# size) and num_stages (the ring's depth); block_q follows from the group (64 rows per tile) and
# num_warps is one warpgroup. Starting points for scripts/gpu_check.sh's sweep.
TUNED: dict[tuple[int, int, str], BlockSizes] = {
    (head, page, dtype): BlockSizes(ROWS, max(1, 64 // page), num_stages=2)
    for head in (64, 128) for page in (16, 32, 64) for dtype in DTYPES
}


def supports(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether this kernel serves the layout (else use the Triton kernel): 16-bit q, caches of its
    dtype or FP8, head size a multiple of 64, pages of 8+ tokens, at most 64 query heads per KV head."""
    head_size, page_size, num_kv_heads = q.shape[-1], k_cache.shape[1], num_kv_heads_of(k_cache, q.shape[-1])
    return (jnp.dtype(q.dtype).name in DTYPES and k_cache.dtype in (q.dtype, FP8) and head_size % 64 == 0
            and page_size % 8 == 0 and q.shape[1] // num_kv_heads <= ROWS)


def paged_attention_mosaic(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata, *,
                           scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, interpret: bool | None = None,
                           sizes: BlockSizes | None = None) -> jax.Array:
    """q [T, N, H], caches [P, S, K*H] or [P, S, K, H] -> [T, N, H]; same contract as
    ``reference.paged_attention``. ``interpret=None`` interprets on the CPU (Mosaic GPU's interpreter) and compiles elsewhere.
    ``sizes``: pages_per_block (keys per iteration / page size) and num_stages (the ring's depth)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    validate(q, k_cache, v_cache, md)
    num_tokens, num_heads, head_size = q.shape
    k_cache, v_cache = heads_apart(k_cache, head_size), heads_apart(v_cache, head_size)
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    sizes = sizes or TUNED.get((head_size, page_size, q.dtype.name), BlockSizes(ROWS, max(1, 64 // page_size)))
    _validate_layout(q, k_cache, sizes)
    group = num_heads // num_kv_heads
    group_p = pl.next_power_of_2(group)
    block_q = ROWS // group_p
    tiles, qk, tables = prepare_tiles(q, md, scale, group_p, block_q, sizes.pages_per_block, num_kv_heads)
    row, first, count, first_pos = tiles
    # Tile-major queries [K, tiles * 64, H]: each tile's TMA load starts on a 64-row boundary
    # (Mosaic GPU cannot lay out a copy from an unaligned dynamic row offset).
    qk = qk[:, (first[:, None] * group_p + jnp.arange(ROWS)[None, :]).reshape(-1)]
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    body = functools.partial(_kernel, plgpu=plgpu, group=group, group_p=group_p, page_size=page_size,
                             pages_per_block=sizes.pages_per_block, stages=sizes.num_stages,
                             sliding_window=sliding_window, soft_cap=soft_cap, has_sinks=sinks is not None)
    extra = () if sinks is None else (sinks.astype(jnp.float32).reshape(num_kv_heads, group),)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_kv_heads, row.shape[0] * ROWS, head_size), q.dtype),
        grid=(row.shape[0], num_kv_heads),
        grid_names=("tile", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if interpret else False,
    )(row, count, first_pos, tables, qk, k_cache, v_cache, *extra)
    return gather_tile_outputs(out, md, num_tokens, block_q, group_p, group)


def _validate_layout(q: jax.Array, k_cache: jax.Array, sizes: BlockSizes) -> None:
    if not supports(q, k_cache):
        raise ValueError(f"mosaic kernel: needs a 16-bit q and caches of its dtype or FP8, a head size that is a multiple "
                         f"of 64, a page size of 8 or more and at most {ROWS} query heads per KV head; got "
                         f"{q.dtype}/{k_cache.dtype}, head size {q.shape[-1]}, page size {k_cache.shape[1]}, "
                         f"{q.shape[1] // num_kv_heads_of(k_cache, q.shape[-1])} heads per KV head")
    span = sizes.pages_per_block * k_cache.shape[1]
    if span % 64 or span > 256 or sizes.num_stages < 2:
        # 64: a 128-byte swizzle of 16-bit keys (WGMMA's K for P @ V); 256: WGMMA's largest N.
        raise ValueError(f"mosaic kernel: keys per iteration (pages_per_block * page size) must be 64, 128, 192 or "
                         f"256 and num_stages >= 2; got {span} and {sizes.num_stages}")
    staged = 2 * span if k_cache.dtype == FP8 else 0          # FP8: K and V tiles converted for WGMMA
    smem = ((ROWS + staged) * q.dtype.itemsize + 2 * sizes.num_stages * span * k_cache.dtype.itemsize) * q.shape[-1]
    if smem > SMEM_BYTES:
        raise ValueError(f"mosaic kernel: {smem} bytes of shared memory for the query tile and a ring of "
                         f"{sizes.num_stages} x {span} keys exceed Hopper's {SMEM_BYTES}; fewer stages or keys")


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _kernel(row_ref, count_ref, pos_ref, tables_ref, q_ref, k_ref, v_ref, *refs, plgpu,
            group, group_p, page_size, pages_per_block, stages, sliding_window, soft_cap, has_sinks):
    sinks_ref, o_ref = refs if has_sinks else (None, *refs)
    head_size, dtype, cache_dtype = q_ref.shape[-1], q_ref.dtype, k_ref.dtype
    span = pages_per_block * page_size
    staged = cache_dtype != dtype                  # an FP8 cache: converted in shared memory

    def transforms(of):
        itemsize = jnp.dtype(of).itemsize
        swizzle = min(SWIZZLE, head_size * itemsize)
        return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)

    def scoped(qo_smem, k_ring, v_ring, q_barrier, k_barriers, v_barriers, *staging):
        tile, head = jax.lax.axis_index("tile"), jax.lax.axis_index("head")
        k_stage, v_stage = staging or (None, None)
        row, count, first_pos = row_ref[tile], count_ref[tile], pos_ref[tile]
        plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(tile * ROWS, ROWS)], qo_smem, q_barrier)
        start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0) // span
        stop = jnp.where(count > 0, (first_pos + count - 1) // span + 1, 0)

        def fetch(step, slot):
            """One TMA copy per page of the step's K and V head slices; each barrier expects one
            arrival per page."""
            for j in range(pages_per_block):
                page = tables_ref[row, step * pages_per_block + j]
                rows = pl.ds(j * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_ref.at[page, :, head, :], k_ring.at[slot, rows], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, head, :], v_ring.at[slot, rows], v_barriers.at[slot])

        def arrived(ring, barriers, slot, stage):
            """The slot's tile, once its copies have landed: the ring's own, or (FP8) its values
            converted into the staging tile, which the previous step's WGMMAs have finished reading."""
            plgpu.barrier_wait(barriers.at[slot])
            if stage is None:
                return ring.at[slot]
            # e4m3 -> f16 is one PTX conversion and exact; to bf16 by way of it (PTX before 9.2
            # has no direct e4m3 -> bf16).
            stage[...] = ring.at[slot][...].astype(jnp.float16).astype(dtype)
            plgpu.commit_smem()                    # generic-proxy stores, before WGMMA reads them
            return stage

        for ahead in range(stages - 1):                # fill the ring
            @pl.when(start + ahead < stop)
            def _():
                fetch(start + ahead, ahead)

        plgpu.barrier_wait(q_barrier)
        q_row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, span), 0)
        key = jax.lax.broadcasted_iota(jnp.int32, (ROWS, span), 1)
        q_pos = first_pos + q_row // group_p
        q_real = (q_row // group_p < count) & (q_row % group_p < group)

        def step(i, carry):
            acc, m, l = carry
            slot = jax.lax.rem(i - start, stages)

            @pl.when(i + stages - 1 < stop)
            def _():
                # The slot it refills was last read by step i - 1, whose WGMMAs have completed.
                fetch(i + stages - 1, jax.lax.rem(i - start + stages - 1, stages))

            k_tile = arrived(k_ring, k_barriers, slot, k_stage)

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_tile.transpose((1, 0)))   # plgpu.transpose_ref: deprecated in JAX 0.11
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((ROWS, span), jnp.float32))
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key_pos = i * span + key
            mask = (key_pos <= q_pos) & q_real
            if sliding_window is not None:
                mask &= key_pos > q_pos - sliding_window
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)      # no key yet: keep exp finite
            p = jnp.exp(s - jax.lax.broadcast_in_dim(m_safe, s.shape, [0]))
            correction = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
            l = l * correction + p.sum(axis=1)
            acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0])
            p16 = p.astype(dtype)
            v_tile = arrived(v_ring, v_barriers, slot, v_stage)

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_tile)
                return acc_ref[...]

            return acc + pl.run_scoped(values, plgpu.ACC((ROWS, head_size), jnp.float32)), m_new, l

        m0, l0 = jnp.full((ROWS,), -jnp.inf, jnp.float32), jnp.zeros((ROWS,), jnp.float32)
        if has_sinks:
            # The sink (a first key of value 0, as online_softmax): each row's query head's logit,
            # read as scalars and laid out as the scores' row maxima are.
            per_row = jnp.full((ROWS, span), -jnp.inf, jnp.float32)
            for j in range(group):
                per_row = jnp.where(q_row % group_p == j, sinks_ref[head, j], per_row)
            m0 = per_row.max(axis=1)
            l0 = jnp.where(m0 == -jnp.inf, 0.0, 1.0)
        init = (jnp.zeros((ROWS, head_size), jnp.float32), m0, l0)
        acc, _, l = jax.lax.fori_loop(start, stop, step, init)
        l = jnp.where(l > 0, l, 1.0)
        qo_smem[...] = (acc / jax.lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[head, pl.ds(tile * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    staging = [plgpu.SMEM((span, head_size), dtype, transforms=transforms(dtype))] * 2 if staged else []
    pl.run_scoped(
        scoped,
        plgpu.SMEM((ROWS, head_size), dtype, transforms=transforms(dtype)),
        plgpu.SMEM((stages, span, head_size), cache_dtype, transforms=transforms(cache_dtype)),
        plgpu.SMEM((stages, span, head_size), cache_dtype, transforms=transforms(cache_dtype)),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        *staging,
    )
