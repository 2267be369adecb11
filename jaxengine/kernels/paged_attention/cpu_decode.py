"""The CPU's decode attention as a small compiled kernel (``cpu_decode.cc``) called through
``jax.ffi``: it reads each row's pages in place, where XLA gathers them into a temporary first, and
shares the rows between the cores through XLA's own thread pool (BENCHMARKS.md, "decode attention
read in place").

It is built on first use (``kernels.cpu_build``). Without a compiler ``available()`` is False and
the plain-jnp path serves (a warning says why, once); ``attention_backend="reference"`` chooses
that path outright.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.cpu_build import register_kernel
from jaxengine.kernels.paged_attention.layout import heads_together, is_fp8, num_kv_heads

SOURCE = Path(__file__).with_name("cpu_decode.cc")
TARGET = "jaxengine_paged_decode"
MAX_HEADS, MAX_PAGE = 128, 64         # the kernel's kMaxHeads and kMaxPage


def serves(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether the kernel serves this layer on this backend: an f32 or FP8 cache, a CPU, N and S in
    its limits."""
    num_heads, kv_heads = q.shape[1], num_kv_heads(k_cache, q.shape[2])
    return (jax.default_backend() == "cpu" and (k_cache.dtype == jnp.float32 or is_fp8(k_cache.dtype))
            and num_heads % kv_heads == 0
            and num_heads <= MAX_HEADS and k_cache.shape[1] <= MAX_PAGE and available())


@functools.cache
def available() -> bool:
    return register_kernel(SOURCE, "JaxenginePagedDecode", TARGET, "CPU decode-attention")


def paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array, lens: jax.Array, *,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 sinks: jax.Array | None = None) -> jax.Array:
    """q [B, N, H] f32, already scaled; caches [P, S, K*H] (or [P, S, K, H]), f32 or float8_e4m3fn
    (or its bytes, ``layout``; their scales applied by the caller); tables [B, M]; lens [B] keys each row attends to (0: a
    padding row, whose output is zeros); sinks [N] or None -> [B, N, H] f32."""
    if not available():
        raise RuntimeError("the CPU decode-attention kernel is not available (see the warning logged)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    sinks = jnp.full(q.shape[1], -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return call(q.astype(jnp.float32), heads_together(k_cache), heads_together(v_cache), tables.astype(jnp.int32), lens.astype(jnp.int32), sinks,
                sliding_window=int(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))
