"""Random ragged paged-attention batches and the dense attention they must give: shared by the
kernel tests (and by the GPU check, which may run where hypothesis is not installed)."""
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.paged_attention import AttentionMetadata, write_kv

H = 16


def make_batch(rng, rows, page_size, kv_heads, group, num_tokens, num_rows, head_size=H, num_pages=0, max_blocks=0):
    """rows: (context before the step, new tokens). Returns q, caches, metadata, per-row K/V.
    ``num_pages`` / ``max_blocks``: at least this many cache pages / block-table columns (fixed
    shapes compile once)."""
    H = head_size
    n_pages = max(sum(-(-(c + n) // page_size) for c, n in rows) + 1, num_pages)
    k_cache = np.zeros((n_pages + 1, page_size, kv_heads, H), np.float32)
    v_cache = np.zeros_like(k_cache)
    perm = rng.permutation(np.arange(1, n_pages + 1))            # scattered pages
    tables, used, full = [], 0, []
    for c, n in rows:
        count = -(-(c + n) // page_size)
        tables.append(perm[used:used + count].tolist())
        used += count
        k = rng.standard_normal((c + n, kv_heads, H)).astype(np.float32)
        v = rng.standard_normal((c + n, kv_heads, H)).astype(np.float32)
        for p in range(c):                                       # the context already in the cache
            k_cache[tables[-1][p // page_size], p % page_size] = k[p]
            v_cache[tables[-1][p // page_size], p % page_size] = v[p]
        full.append((k, v))
    md = AttentionMetadata.build([(c, n, t) for (c, n), t in zip(rows, tables)], page_size, num_tokens,
                                 max_blocks=max(max(len(t) for t in tables) + 1, max_blocks), num_rows=num_rows)
    new_k = np.concatenate([k[c:] for (c, n), (k, v) in zip(rows, full)] + [np.zeros((num_tokens - sum(n for _, n in rows), kv_heads, H), np.float32)])
    new_v = np.concatenate([v[c:] for (c, n), (k, v) in zip(rows, full)] + [np.zeros((num_tokens - sum(n for _, n in rows), kv_heads, H), np.float32)])
    q = rng.standard_normal((num_tokens, kv_heads * group, H)).astype(np.float32)
    kc, vc = write_kv(jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(new_k), jnp.asarray(new_v), md.slot_mapping)
    return jnp.asarray(q), kc, vc, md, full


def dense(q, rows, full, group, scale, window=None, cap=None, sinks=None):
    out, t = np.zeros_like(np.asarray(q)), 0
    for (c, n), (k, v) in zip(rows, full):
        for i in range(n):
            pos = c + i
            keys = np.arange(pos + 1)
            if window:
                keys = keys[keys > pos - window]
            kk, vv = np.repeat(k[keys], group, axis=1), np.repeat(v[keys], group, axis=1)
            s = np.einsum("nh,snh->ns", np.asarray(q)[t] * scale, kk)
            if cap:
                s = cap * np.tanh(s / cap)
            top = s.max(-1, keepdims=True) if sinks is None else np.maximum(s.max(-1), sinks)[:, None]
            p = np.exp(s - top)
            total = p.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[:, None] - top))
            out[t] = np.einsum("ns,snh->nh", p / total, vv)
            t += 1
    return out


def with_sinks(extras: dict, num_heads: int, seed: int) -> dict:
    """``extras`` with ``sinks: std`` replaced by random sink logits [N] of that spread."""
    if "sinks" not in extras:
        return extras
    sinks = np.random.default_rng(seed + 1).normal(0, extras["sinks"], num_heads).astype(np.float32)
    return {**extras, "sinks": jnp.asarray(sinks)}


def _sinks(extras: dict):
    return None if extras.get("sinks") is None else np.asarray(extras["sinks"])


def fp8_cache(cache, scale: float):
    """An FP8 cache of ``cache`` / scale (as models.layers writes one) and the f32 values it holds."""
    from jaxengine.models.layers import to_fp8

    stored = to_fp8(cache, jnp.float32(scale))
    return stored, stored.astype(jnp.float32) * scale
