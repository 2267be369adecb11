"""The KV cache's layout: pages [P, S, K*H], each token's heads one after another, as stored and as
the model's layers hand them to the kernels; [P, S, K, H] is the same memory with the heads apart.

The model keeps one shape from the stored cache through its KV write to its attention: where the
written cache was read in two shapes (a reshape on the way to a kernel), XLA's CPU compiler
duplicated the write into each shape's consumer and copied the whole pool to do it, in every
layer of every step. A kernel that wants the heads apart takes this view at its own entry."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def heads_apart(cache: jax.Array, head_size: int) -> jax.Array:
    """[P, S, K*H] (or [P, S, K, H]) -> [P, S, K, H]."""
    return cache if cache.ndim == 4 else cache.reshape(*cache.shape[:2], -1, head_size)


def heads_together(cache: jax.Array) -> jax.Array:
    """[P, S, K, H] (or [P, S, K*H]) -> [P, S, K*H]."""
    return cache if cache.ndim == 3 else cache.reshape(*cache.shape[:2], -1)


def num_kv_heads(cache: jax.Array, head_size: int) -> int:
    """K, for a cache in either form whose heads are ``head_size`` wide."""
    return cache.shape[2] if cache.ndim == 4 else cache.shape[2] // head_size


# An FP8 KV cache (float8_e4m3fn) is stored as its bytes on the CPU: XLA's CPU backend writes no
# float8 array in place (it converts the whole cache to float16 and back, or, through a bitcast,
# rewrites it whole), so there the pool is uint8 and only what a step writes or gathers is viewed
# as float8. Elsewhere it is stored as float8 and the kernels read it as it is.
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_BYTES = jnp.dtype(jnp.uint8)


def storage_dtype(dtype, platform: str) -> jnp.dtype:
    """The dtype a KV cache of ``dtype`` is stored in on ``platform``."""
    return FP8_BYTES if jnp.dtype(dtype) == FP8 and platform == "cpu" else jnp.dtype(dtype)


def is_fp8(dtype) -> bool:
    """Whether a cache of this (stored) dtype holds float8_e4m3fn values."""
    return jnp.dtype(dtype) in (FP8, FP8_BYTES)


def values(pages: jax.Array) -> jax.Array:
    """Pages gathered from a cache, as the values they hold (float8 for a cache of FP8 bytes). For
    a gathered piece, never the whole cache (that would rewrite it)."""
    return jax.lax.bitcast_convert_type(pages, FP8) if pages.dtype == FP8_BYTES else pages


def as_stored(rows: jax.Array, cache_dtype) -> jax.Array:
    """New rows in a cache's stored dtype (an FP8 cache's bytes: rows converted to float8 first)."""
    if jnp.dtype(cache_dtype) == FP8_BYTES:
        return jax.lax.bitcast_convert_type(rows.astype(FP8), FP8_BYTES)
    return rows.astype(cache_dtype)
