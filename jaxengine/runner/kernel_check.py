"""The start-up check of the model's attention kernel and KV write.

On an accelerator the model runs Pallas kernels that the CPU test suite only ever interprets.
Before serving, both run once on a small random mixed batch in the model's own layout (its
query and KV heads, head size, page size and dtype) and are compared with the plain-jnp path: a
kernel that fails to compile or disagrees beyond the dtype's tolerance is logged with the reason
and replaced by the plain-jnp path, so a kernel bug costs speed, never wrong text.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention, paged_attention_tiled, write_kv
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import attention_modules, kernel_name

logger = logging.getLogger(__name__)

# Largest |kernel - reference| allowed, as a fraction of the reference's largest |output|:
# f32 dots run at full precision; 16-bit caches round the softmax weights and the output.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}


@dataclass(frozen=True)
class CheckBatch:
    q: jax.Array                # [T, N, H]
    k_cache: jax.Array          # [P, S, K, H], random: the context already cached
    v_cache: jax.Array
    k_new: jax.Array            # [T, K, H]: this step's rows, written at md.slot_mapping
    v_new: jax.Array
    md: AttentionMetadata
    num_real_tokens: int        # the tokens past it are padding (slot 0, the null block)


def check_model_kernels(model, model_config: ModelConfig, block_size: int, dtype, *,
                        enabled: bool | None = None) -> None:
    """Check the model's attention kernel and KV write and put the plain-jnp path in place of any
    that fails (the plain-jnp path itself is not checked). ``enabled=None``: on an accelerator
    only (the CPU runs the plain-jnp path unless told otherwise); True forces it, False skips it."""
    if not (_on_accelerator() if enabled is None else enabled):
        return
    for attention in attention_modules(model):
        attention_problem, kv_problem = check_kernels(attention.attention_fn, attention.kv_write_fn,
                                                      model_config, block_size, dtype)
        if not attention_problem and not kv_problem:
            logger.info("attention kernel %s and KV write %s match the plain-jnp path",
                        kernel_name(attention.attention_fn), kernel_name(attention.kv_write_fn))
        if attention_problem:
            logger.warning("attention kernel %s %s; using the plain-jnp path instead",
                           kernel_name(attention.attention_fn), attention_problem)
            attention.attention_fn = paged_attention_tiled
        if kv_problem:
            logger.warning("KV write %s %s; using the XLA scatter instead", kernel_name(attention.kv_write_fn),
                           kv_problem)
            attention.kv_write_fn = write_kv


def check_kernels(attention_fn: Callable, kv_write_fn: Callable, model_config: ModelConfig, block_size: int,
                  dtype, seed: int = 0) -> tuple[str | None, str | None]:
    """-> (what is wrong with the attention kernel, with the KV write); None where it matches."""
    if attention_fn is paged_attention_tiled and kv_write_fn is write_kv:
        return None, None
    batch = mixed_batch(model_config, block_size, dtype, seed)
    kv_problem = None if kv_write_fn is write_kv else _kv_write_problem(kv_write_fn, batch)
    attention_problem = None
    if attention_fn is not paged_attention_tiled:
        attention_problem = _attention_problem(attention_fn, batch, model_config.sliding_window)
    return attention_problem, kv_problem


def mixed_batch(cfg: ModelConfig, block_size: int, dtype, seed: int = 0) -> CheckBatch:
    """Three decodes over contexts of several pages, a prefill chunk after a cached prefix, a whole
    prompt, then padding tokens and a padding row; the rows' pages scattered through the pool."""
    rows = [(2 * block_size + 3, 1), (block_size - 1, 1), (5, 1), (block_size + 2, block_size + 5), (0, 7)]
    rng = np.random.default_rng(seed)
    pages = [-(-(c + n) // block_size) for c, n in rows]
    free = rng.permutation(np.arange(1, sum(pages) + 3))      # block 0 is the null block
    tables = [free[sum(pages[:i]):sum(pages[:i + 1])].tolist() for i in range(len(rows))]
    num_real = sum(n for _, n in rows)
    num_tokens = num_real + 5
    md = AttentionMetadata.build([(c, n, t) for (c, n), t in zip(rows, tables)], block_size, num_tokens,
                                 max(pages) + 1, num_rows=len(rows) + 1)
    keys = jax.random.split(jax.random.key(seed), 5)
    cache_shape = (len(free) + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
    new_shape = (num_tokens, cfg.num_kv_heads, cfg.head_dim)
    k_cache, v_cache = (jax.random.normal(k, cache_shape, dtype) for k in keys[:2])
    k_new, v_new = (jax.random.normal(k, new_shape, dtype) for k in keys[2:4])
    q = jax.random.normal(keys[4], (num_tokens, cfg.num_heads, cfg.head_dim), dtype)
    return CheckBatch(q, k_cache, v_cache, k_new, v_new, md, num_real)


def _kv_write_problem(kv_write_fn: Callable, b: CheckBatch) -> str | None:
    """The written caches must equal the XLA scatter's, bit for bit, outside the null block
    (which padding tokens write to, in no defined order)."""
    args = (b.k_cache, b.v_cache, b.k_new, b.v_new, b.md.slot_mapping)
    want = jax.jit(write_kv)(*args)
    try:
        got = jax.block_until_ready(jax.jit(kv_write_fn)(*args))
    except Exception as error:      # noqa: BLE001 - any failure to compile or run means: do not use it
        return f"failed: {type(error).__name__}: {str(error)[:300]}"
    for name, g, w in zip(("K", "V"), got, want):
        wrong = np.asarray(g[1:] != w[1:]).sum()
        if wrong:
            return f"disagrees with the XLA scatter: {wrong} {name} cache values differ"
    return None


def _attention_problem(attention_fn: Callable, b: CheckBatch, sliding_window: int | None) -> str | None:
    k_cache, v_cache = write_kv(b.k_cache, b.v_cache, b.k_new, b.v_new, b.md.slot_mapping)
    kw = dict(scale=b.q.shape[-1] ** -0.5, sliding_window=sliding_window)
    with jax.default_matmul_precision("highest"):       # the oracle at full f32 precision
        want = np.asarray(paged_attention(b.q, k_cache, v_cache, b.md, **kw), np.float32)[:b.num_real_tokens]
    try:
        got = jax.jit(lambda q, k, v, md: attention_fn(q, k, v, md, **kw))(b.q, k_cache, v_cache, b.md)
        got = np.asarray(got, np.float32)[:b.num_real_tokens]
    except Exception as error:      # noqa: BLE001 - any failure to compile or run means: do not use it
        return f"failed: {type(error).__name__}: {str(error)[:300]}"
    error, limit = attention_error(got, want, b.q.dtype)
    if not error <= limit:
        return f"disagrees with the plain-jnp path: max |difference| {error:.3g} > {limit:.3g}"
    return None


def attention_error(got, want, dtype) -> tuple[float, float]:
    """(largest |got - want|, the most the dtype allows) over the real tokens' outputs; a NaN or
    infinity in ``got`` is an infinite error."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    limit = TOLERANCE.get(jnp.dtype(dtype).name, 1e-2) * float(np.abs(want).max())
    return (float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")), limit


def _on_accelerator() -> bool:
    return jax.devices()[0].platform != "cpu"
