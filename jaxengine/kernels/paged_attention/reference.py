"""Plain-jnp paged attention: the reference every kernel is tested against, and the CPU path.

Each token attends causally over its row's context, read page by page through the row's
block table with an online softmax in f32 (memory stays O(T x block_size) per page).
Shapes: T tokens, N query heads, K KV heads, H head size, P pages, S page (block) size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxengine.kernels.paged_attention import online_softmax
from jaxengine.kernels.paged_attention.layout import FP8, as_stored, heads_apart, values
from jaxengine.kernels.paged_attention.metadata import AttentionMetadata


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows [T, K, H] into caches [P, S, K*H] (or [P, S, K, H]) at their slots."""
    return write_rows(k_cache, k, slot_mapping), write_rows(v_cache, v, slot_mapping)


def write_rows(cache: jax.Array, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new rows [T, ...] into pages [P, S, ...] at their slots (a row is reshaped to the
    pages' row shape). The pages are indexed as they are, never reshaped: see ``layout``."""
    page_size = cache.shape[1]
    rows = rows.reshape(rows.shape[0], *cache.shape[2:])
    return _scatter(cache, (slot_mapping // page_size, slot_mapping % page_size), rows)


def _scatter(cache: jax.Array, slots: tuple[jax.Array, jax.Array], rows: jax.Array) -> jax.Array:
    """cache.at[slots].set(rows) (``slots``: (pages, offsets)); an FP8 cache of bytes (``layout``)
    gets the rows' float8 bytes. A float8 cache (not on the CPU) is scattered as its bytes too."""
    if cache.dtype != FP8:
        return cache.at[slots].set(as_stored(rows, cache.dtype))
    as_bytes = jax.lax.bitcast_convert_type(cache, jnp.uint8)
    new = jax.lax.bitcast_convert_type(rows.astype(cache.dtype), jnp.uint8)
    return jax.lax.bitcast_convert_type(as_bytes.at[slots].set(new), cache.dtype)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata, *,
                    scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """q [T, N, H], caches [P, S, K*H] or [P, S, K, H] -> [T, N, H] in q's dtype. ``sinks`` [N]: a
    learned logit per query head that joins every softmax as a key with a zero value (gpt-oss)."""
    num_tokens, num_heads, head_size = q.shape
    k_cache, v_cache = heads_apart(k_cache, head_size), heads_apart(v_cache, head_size)
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = jnp.minimum(md.token_rows, md.block_tables.shape[0] - 1)
    valid = md.token_rows < md.block_tables.shape[0]
    tables = md.block_tables[rows]                                   # [T, M]
    pos = md.positions
    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, num_kv_heads, group, head_size)

    def page_step(page, carry):
        blocks = tables[:, page]                                     # [T]
        k = values(k_cache[blocks]).astype(jnp.float32)              # [T, S, K, H]
        v = values(v_cache[blocks]).astype(jnp.float32)
        s = jnp.einsum("tkgh,tskh->tkgs", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = page * page_size + jnp.arange(page_size)           # [S]
        mask = (key_pos[None, :] <= pos[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos[:, None] - sliding_window
        return online_softmax.update(carry, s, mask[:, None, None, :],
                                     lambda p: jnp.einsum("tkgs,tskh->tkgh", p, v))

    init = online_softmax.init((num_tokens, num_kv_heads, group), head_size,
                               None if sinks is None else sinks.reshape(num_kv_heads, group))
    # Only the pages some row uses: the trip count follows the longest context, not the table width.
    num_pages = jnp.minimum((jnp.max(md.seq_lens) + page_size - 1) // page_size, tables.shape[1])
    _, l, acc = jax.lax.fori_loop(0, num_pages, page_step, init)
    out = online_softmax.finish(l, acc)
    return out.reshape(num_tokens, num_heads, head_size).astype(q.dtype)
