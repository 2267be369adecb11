"""Paged attention in plain jnp, organised for speed on the CPU (the engine's CPU path).

The reference reads every context page once per query token. Where ``cpu_decode``'s compiled
kernel serves the layer, every token goes through it, each attending to its own causal length
with its row's pages read in place (a prompt's tokens in blocks of queries that read each key
once, ``cpu_decode.cc``; BENCHMARKS.md). Otherwise the
tokens of short rows (a decode, a decode with its speculative draft tokens: at most ``SHORT_ROW``
queries) go one by one through the jnp loop below, and longer (prefill) rows are cut into query
tiles of ``q_tile`` tokens that read each page once per tile. Whichever part a step does
not need is skipped at run time (``lax.cond``). Tested against ``reference.paged_attention``.

Tiles (decode tokens are tiles of one) are sorted by their furthest query position and attended
in groups of ``group_size``, each group looping only as far as its own longest tile: the causal
early tiles of a prompt, short rows and padding tiles no longer loop as far as the step's longest
row (a prompt chunk beside 50 decodes: about 2.6x faster in one layer, BENCHMARKS.md).
Shapes: T tokens, B rows, N query heads, K KV heads, G = N / K, H head size, S page size.

Each loop iteration gathers ``pages_per_step`` pages of every tile into a temporary: 4 keeps it
in the CPU's caches (the default model at batch 64: about 3 MB each for K and V), where 8 spilled
and made the decode attention about a quarter slower (BENCHMARKS.md, "Where a step goes").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxengine.kernels.paged_attention import cpu_decode, online_softmax
from jaxengine.kernels.paged_attention.layout import heads_together, num_kv_heads, values
from jaxengine.kernels.paged_attention.metadata import AttentionMetadata

SHORT_ROW = 8       # rows of at most this many queries attend token by token (the decode kernel)


def paged_attention_tiled(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, md: AttentionMetadata, *,
                          scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                          sinks: jax.Array | None = None, q_tile: int = 16, pages_per_step: int = 4, group_size: int = 8,
                          decode_kernel: bool | None = None) -> jax.Array:
    """q [T, N, H], caches [P, S, K*H] (or [P, S, K, H]) -> [T, N, H]; same contract as
    ``reference.paged_attention``. ``decode_kernel``: decode tokens through ``cpu_decode`` (None:
    wherever it serves the layer; False: the jnp loop below)."""
    num_tokens, num_heads, head_size = q.shape
    num_rows = md.block_tables.shape[0]
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, num_kv_heads(k_cache, head_size), -1, head_size)
    serves = cpu_decode.serves(q, k_cache) if decode_kernel is None else decode_kernel
    # The caches go into the branches, loops and the decode kernel as they are stored, [P, S, K*H]
    # (``layout``): a reshape of the cache on the way would have XLA copy the whole pool.
    k_cache, v_cache = heads_together(k_cache), heads_together(v_cache)
    out = jnp.zeros((num_tokens + 1, *qg.shape[1:]), jnp.float32)        # row T: a sink for padding
    sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(qg.shape[1:3])     # [K, G]
    attend = dict(k_cache=k_cache, v_cache=v_cache, md=md, sliding_window=sliding_window, soft_cap=soft_cap,
                  sinks=sinks, pages_per_step=pages_per_step, group_size=group_size)

    if serves:
        # Every token through the compiled kernel, a prompt's too, each over its own causal length
        # with its row's pages read in place (in the core's cache for the row's later tokens);
        # padding tokens (in no row) attend to nothing and come out zero.
        real = md.token_rows < num_rows
        rows = jnp.minimum(md.token_rows, num_rows - 1)
        got = cpu_decode.paged_decode(qg.reshape(num_tokens, -1, head_size), k_cache, v_cache, md.block_tables[rows],
                                      jnp.where(real, md.positions + 1, 0), sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=None if sinks is None else sinks.reshape(-1))
        return got.reshape(num_tokens, num_heads, head_size).astype(q.dtype)

    # Short rows' tokens: one query per tile, at most min(T, B * SHORT_ROW) of them.
    short = (q_lens >= 1) & (q_lens <= SHORT_ROW)
    is_decode = jnp.repeat(short, q_lens, total_repeat_length=num_tokens)
    dec_idx = jnp.nonzero(is_decode, size=min(num_tokens, num_rows * SHORT_ROW), fill_value=num_tokens)[0]
    decode = lambda o: _scatter(o, *_attend(qg, dec_idx[:, None], **attend))     # noqa: E731
    out = jax.lax.cond(jnp.any(is_decode), decode, lambda o: o, out)

    # Prefill rows: tiles of q_tile consecutive queries of one row.
    tiles_per_row = jnp.where(q_lens > SHORT_ROW, (q_lens + q_tile - 1) // q_tile, 0)
    num_tiles = num_tokens // q_tile + num_rows                          # static bound
    ends = jnp.cumsum(tiles_per_row)
    tile = jnp.arange(num_tiles)
    row = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_rows - 1)
    first = md.query_start_loc[row] + (tile - (ends - tiles_per_row)[row]) * q_tile
    idx = first[:, None] + jnp.arange(q_tile)[None, :]
    idx = jnp.where((tile < ends[-1])[:, None] & (idx < md.query_start_loc[row + 1][:, None]), idx, num_tokens)
    out = jax.lax.cond(ends[-1] > 0, lambda o: _scatter(o, *_attend(qg, idx, **attend)), lambda o: o, out)
    return out[:num_tokens].reshape(num_tokens, num_heads, head_size).astype(q.dtype)


def _scatter(out: jax.Array, idx: jax.Array, tiles: jax.Array) -> jax.Array:
    return out.at[idx.reshape(-1)].set(tiles.reshape(-1, *tiles.shape[2:]))


def _attend(qg: jax.Array, idx: jax.Array, *, md: AttentionMetadata, group_size: int, **attend):
    """Query tiles idx [n, q] (index T = padding) -> (the tiles reordered, their outputs). The
    tiles go longest first in groups of ``group_size``, each looping only over the pages its
    own furthest query reaches: a short row no longer waits for the step's longest one, and
    padding tiles cost one iteration."""
    if idx.shape[0] <= 2 * group_size:         # too few to gain what more loops cost to compile
        return idx, _attend_group(qg, idx, md=md, **attend)
    num_tokens = qg.shape[0]
    last = jnp.max(jnp.where(idx < num_tokens, md.positions[jnp.minimum(idx, num_tokens - 1)], -1), axis=1)
    idx = idx[jnp.argsort(-last)]
    groups = [_attend_group(qg, idx[s:s + group_size], md=md, **attend) for s in range(0, idx.shape[0], group_size)]
    return idx, jnp.concatenate(groups) if len(groups) > 1 else groups[0]


def _attend_group(qg: jax.Array, idx: jax.Array, *, k_cache, v_cache, md: AttentionMetadata, sliding_window,
                  soft_cap, sinks, pages_per_step: int) -> jax.Array:
    """Online-softmax attention of query tiles idx [n, q] (index T = padding) over their row's
    pages, ``pages_per_step`` pages per loop iteration. Einsums keep (tile, KV head) as leading
    batch dimensions: plain batched matmuls."""
    num_tokens = qg.shape[0]
    valid = idx < num_tokens
    safe = jnp.minimum(idx, num_tokens - 1)
    n, q = idx.shape
    kh, g, h = qg.shape[1:]
    qt = qg[safe].transpose(0, 2, 1, 3, 4).reshape(n, kh, q * g, h)     # [n, K, q*G, H]
    pos = md.positions[safe]                                             # [n, q]
    pos_m = jnp.repeat(pos, g, axis=1).reshape(n, 1, q * g, 1)           # matches q*G ordering
    valid_m = jnp.repeat(valid, g, axis=1).reshape(n, 1, q * g, 1)
    rows = jnp.minimum(jnp.searchsorted(md.query_start_loc[1:], safe[:, 0], side="right"),
                       md.block_tables.shape[0] - 1)
    page_size = k_cache.shape[1]
    width = md.block_tables.shape[1]
    padded = -(-width // pages_per_step) * pages_per_step
    tables = jnp.pad(md.block_tables[rows], ((0, 0), (0, padded - width)))   # [n, M'] (null block)
    span = pages_per_step * page_size

    def step(i, carry):
        blocks = jax.lax.dynamic_slice_in_dim(tables, i * pages_per_step, pages_per_step, axis=1)
        k = values(k_cache[blocks]).astype(jnp.float32).reshape(n, span, kh, h).transpose(0, 2, 1, 3)   # [n, K, s, H]
        v = values(v_cache[blocks]).astype(jnp.float32).reshape(n, span, kh, h).transpose(0, 2, 1, 3)
        s = jnp.einsum("nkmh,nksh->nkms", qt, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = (i * span + jnp.arange(span)).reshape(1, 1, 1, span)
        mask = (key_pos <= pos_m) & valid_m
        if sliding_window is not None:
            mask &= key_pos > pos_m - sliding_window
        return online_softmax.update(carry, s, mask, lambda p: jnp.einsum("nkms,nksh->nkmh", p, v))

    init = online_softmax.init((n, kh, q * g), h, None if sinks is None else jnp.tile(sinks, (1, q)))
    last_pos = jnp.max(jnp.where(valid, pos, 0))
    _, l, acc = jax.lax.fori_loop(0, last_pos // span + 1, step, init)
    out = online_softmax.finish(l, acc)                                              # [n, K, q*G, H]
    return out.reshape(n, kh, q, g, h).transpose(0, 2, 1, 3, 4)                      # [n, q, K, G, H]
