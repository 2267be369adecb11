"""Ragged paged attention as one Pallas kernel (GPU, Triton lowering; interpret mode on CPU).

One launch serves a flat batch in which each request contributes a query chunk of any length
(1 for a decode, many for a prefill chunk, after a prefix-cache hit or not). The chunks are cut
into query tiles of ``block_q`` tokens; the grid is (tile, KV head). A program loads its tile's
queries for the G query heads of its KV head as one [block_q * G, H] matrix (so a decode tile of
one token still feeds the matrix units with >= 16 rows), walks the request's pages through its
block table ``pages_per_block`` pages at a time up to its last query's position, and keeps an
online softmax in f32. Padding tiles run no iteration; padding tokens' outputs are zero.

Shapes: T tokens, B rows, N query heads, K KV heads, G = N / K, H head size, S page size, P pages.
The KV writes stay an XLA scatter (``reference.write_kv``), done before this kernel in the layer.
An FP8 (float8_e4m3fn) cache is read as stored and converted to the queries' dtype in the kernel
(the CPU's cache of FP8 bytes, ``layout``, is viewed as float8 as each block is loaded); its
per-tensor scales are applied outside it (``models.layers.Attention``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxengine.kernels.paged_attention.metadata import AttentionMetadata
from jaxengine.kernels.paged_attention.layout import heads_apart, values


# f32 dots at full f32 precision (Triton would use TF32 by default); bf16 dots are unaffected.
EXACT = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class BlockSizes:
    block_q: int            # query tokens per tile
    pages_per_block: int    # pages per inner-loop iteration
    num_warps: int = 4
    num_stages: int = 2


# Tuned by (head size, page size, dtype name). A tile needs >= 16 rows for the matrix units;
# the table gives block_q for one query head per KV head and ``block_sizes`` scales it. The entries are
# the starting points of scripts/gpu_check.sh's sweep: change them when it measures better.
TUNED: dict[tuple[int, int, str], BlockSizes] = {
    (64, 16, "bfloat16"): BlockSizes(16, 4),
    (64, 32, "bfloat16"): BlockSizes(16, 2),
    (128, 16, "bfloat16"): BlockSizes(16, 4, num_warps=4),
    (128, 32, "bfloat16"): BlockSizes(16, 2, num_warps=4),
    (64, 16, "float32"): BlockSizes(16, 2),
    (64, 32, "float32"): BlockSizes(16, 1),
    (128, 16, "float32"): BlockSizes(16, 2),
    (128, 32, "float32"): BlockSizes(16, 1),
}


def block_sizes(head_size: int, page_size: int, dtype, group_p: int) -> BlockSizes:
    """The tuned sizes for this layout, with block_q scaled so a tile has block_q * Gp = 16 rows
    or more (Gp: the query heads per KV head, padded to a power of two)."""
    base = TUNED.get((head_size, page_size, jnp.dtype(dtype).name), BlockSizes(16, max(1, 64 // page_size)))
    block_q = max(base.block_q // group_p, 16 // group_p, 1)
    return BlockSizes(block_q, base.pages_per_block, base.num_warps, base.num_stages)


def validate(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata) -> None:
    """Clear errors for inputs the kernel cannot serve."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, N, H], got shape {q.shape}")
    if k_cache.ndim not in (3, 4) or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache: expected two [P, S, K*H] or [P, S, K, H] arrays, got {k_cache.shape} and "
                         f"{v_cache.shape}")
    num_tokens, num_heads, head_size = q.shape
    if k_cache.ndim == 3 and k_cache.shape[2] % head_size:
        raise ValueError(f"k_cache: a row of {k_cache.shape[2]} is not a whole number of q's heads of {head_size}")
    _, page_size, num_kv_heads, cache_head_size = heads_apart(k_cache, head_size).shape
    if cache_head_size != head_size:
        raise ValueError(f"k_cache: head size {cache_head_size} differs from q's {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for name, size in (("head size", head_size), ("page size", page_size)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton blocks), got {size}")
    if md.positions.shape != (num_tokens,) or md.block_tables.ndim != 2:
        raise ValueError("md: positions must be [T] and block_tables [B, M]")


def paged_attention_pallas(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata, *,
                           scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, interpret: bool | None = None,
                           sizes: BlockSizes | None = None) -> jax.Array:
    """q [T, N, H], caches [P, S, K*H] or [P, S, K, H] -> [T, N, H]; same contract as
    ``reference.paged_attention``. ``interpret=None`` interprets on the CPU and compiles elsewhere."""
    validate(q, k_cache, v_cache, md)
    num_tokens, num_heads, head_size = q.shape
    k_cache, v_cache = heads_apart(k_cache, head_size), heads_apart(v_cache, head_size)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = pl.next_power_of_2(group)           # Triton blocks are powers of two: pad the heads
    sizes = sizes or block_sizes(head_size, k_cache.shape[1], q.dtype, group_p)
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    tiles, qk, tables = prepare_tiles(q, md, scale, group_p, sizes.block_q, sizes.pages_per_block, num_kv_heads)
    num_tiles, rows = tiles[0].shape[0], sizes.block_q * group_p
    kernel = functools.partial(_kernel, rows=rows, group=group, group_p=group_p, page_size=k_cache.shape[1],
                               pages_per_block=sizes.pages_per_block, sliding_window=sliding_window,
                               soft_cap=soft_cap, has_sinks=sinks is not None)
    extra = () if sinks is None else (tile_row_sinks(sinks, num_kv_heads, group_p, sizes.block_q),)
    # Output rows per tile (disjoint: no program writes another's rows), gathered back below.
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_tiles * rows, head_size), q.dtype),
        interpret=interpret,
        compiler_params=_compiler_params(sizes, interpret),
        name="ragged_paged_attention",
    )(*tiles, tables, qk, k_cache, v_cache, *extra)
    return gather_tile_outputs(out, md, num_tokens, sizes.block_q, group_p, group)


def tile_row_sinks(sinks: jax.Array, num_kv_heads: int, group_p: int, block_q: int) -> jax.Array:
    """Sinks [N] as the rows of a tile see them: [K, block_q * Gp], row r holding query head
    r % Gp of its KV head's group (-inf for the padding heads: no sink)."""
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, -1)
    per_head = jnp.pad(per_head, ((0, 0), (0, group_p - per_head.shape[1])), constant_values=-jnp.inf)
    return jnp.tile(per_head, (1, block_q))


def prepare_tiles(q: jax.Array, md: AttentionMetadata, scale: float, group_p: int, block_q: int,
                  pages_per_block: int, num_kv_heads: int) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
    """The per-tile scalars (``_tiles``), the scaled queries as [K, (T + block_q) * Gp, H] (a tile's
    queries for one KV head are contiguous rows; the tail padding lets the last tile load a full
    block) and the block tables padded to a multiple of ``pages_per_block``."""
    num_tokens, num_heads, head_size = q.shape
    group = num_heads // num_kv_heads
    qk = (q * scale).astype(q.dtype).reshape(num_tokens, num_kv_heads, group, head_size).transpose(1, 0, 2, 3)
    qk = jnp.pad(qk, ((0, 0), (0, block_q), (0, group_p - group), (0, 0))).reshape(num_kv_heads, -1, head_size)
    width = md.block_tables.shape[1]
    tables = jnp.pad(md.block_tables, ((0, 0), (0, -width % pages_per_block)))
    return _tiles(md, num_tokens, block_q), qk, tables


def gather_tile_outputs(out: jax.Array, md: AttentionMetadata, num_tokens: int, block_q: int, group_p: int,
                        group: int) -> jax.Array:
    """Per-tile outputs [K, tiles * block_q * Gp, H] back to [T, N, H]; padding tokens are zero."""
    num_kv_heads, _, head_size = out.shape
    out = out.reshape(num_kv_heads, -1, group_p, head_size)
    out = out[:, _token_tile_rows(md, num_tokens, block_q), :group]                    # [K, T, G, H]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_kv_heads * group, head_size)
    real = jnp.arange(num_tokens) < md.query_start_loc[-1]
    return jnp.where(real[:, None, None], out, 0)                  # keeps the kernel output dtype


def _compiler_params(sizes: BlockSizes, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages)


def _row_tiles(md: AttentionMetadata, block_q: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row: query length, tiles, and the index of its first tile."""
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    tiles_per_row = (q_lens + block_q - 1) // block_q
    return q_lens, tiles_per_row, jnp.cumsum(tiles_per_row) - tiles_per_row


def _tiles(md: AttentionMetadata, num_tokens: int, block_q: int) -> tuple[jax.Array, ...]:
    """Per query tile (a static upper bound of them): its row, first token, number of real
    tokens (0 for padding tiles) and the position of its first token."""
    num_rows = md.block_tables.shape[0]
    q_lens, tiles_per_row, first_tile = _row_tiles(md, block_q)
    ends = first_tile + tiles_per_row
    tile = jnp.arange(num_tokens // block_q + num_rows)
    row = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_rows - 1)
    within = tile - first_tile[row]
    first = md.query_start_loc[row] + within * block_q
    count = jnp.where(tile < ends[-1], jnp.clip(md.query_start_loc[row + 1] - first, 0, block_q), 0)
    first_pos = md.seq_lens[row] - q_lens[row] + within * block_q
    return tuple(a.astype(jnp.int32) for a in (row, jnp.where(count > 0, first, 0), count, first_pos))


def _token_tile_rows(md: AttentionMetadata, num_tokens: int, block_q: int) -> jax.Array:
    """[T] each token's row in the per-tile output (tile * block_q + offset; padding: 0)."""
    _, _, first_tile = _row_tiles(md, block_q)
    row = jnp.minimum(md.token_rows, md.block_tables.shape[0] - 1)
    within = jnp.arange(num_tokens) - md.query_start_loc[row]
    return jnp.where(md.token_rows < md.block_tables.shape[0],
                     (first_tile[row] + within // block_q) * block_q + within % block_q, 0)


def _kernel(row_ref, first_ref, count_ref, pos_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
            rows: int, group: int, group_p: int, page_size: int, pages_per_block: int,
            sliding_window: int | None, soft_cap: float | None, has_sinks: bool):
    sinks_ref, o_ref = refs if has_sinks else (None, *refs)
    tile, head = pl.program_id(0), pl.program_id(1)
    row, first, count, first_pos = row_ref[tile], first_ref[tile], count_ref[tile], pos_ref[tile]
    span = pages_per_block * page_size
    q = q_ref[head, pl.ds(first * group_p, rows), :]                              # [R, H]
    iota = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    q_pos = first_pos + iota // group_p                                            # [R]
    q_real = (iota // group_p < count) & (iota % group_p < group)
    start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0) // span
    stop = jnp.where(count > 0, (first_pos + count - 1) // span + 1, 0)

    def body(i, carry):
        m, l, acc = carry
        pages = tables_ref[row, pl.ds(i * pages_per_block, pages_per_block)]
        # values(): an FP8 cache stored as bytes (the CPU) is viewed as float8, not cast from integers
        k = values(k_ref[pages, :, head, :]).reshape(span, -1)                    # [span, H]
        v = values(v_ref[pages, :, head, :]).reshape(span, -1)
        if k.dtype != q.dtype:                  # an FP8 cache: dequantised here, its scales outside
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=EXACT, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * span + jax.lax.broadcasted_iota(jnp.int32, (rows, span), 1)
        mask = (key_pos <= q_pos[:, None]) & q_real[:, None]
        if sliding_window is not None:
            mask &= key_pos > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                         # no key yet: keep exp finite
        p = jnp.exp(s - m_safe[:, None])
        correction = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe))
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=EXACT,
                                 preferred_element_type=jnp.float32)
        return m_new, l * correction + p.sum(axis=1), acc * correction[:, None] + pv

    m0, l0 = jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)
    if has_sinks:                               # the sink: a first key of value 0 (online_softmax)
        m0 = sinks_ref[head, :]
        l0 = jnp.where(m0 == -jnp.inf, 0.0, 1.0)
    _, l, acc = jax.lax.fori_loop(start, stop, body, (m0, l0, jnp.zeros((rows, q.shape[1]), jnp.float32)))
    o_ref[head, pl.ds(tile * rows, rows), :] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
