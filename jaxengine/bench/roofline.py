"""A floor per token from this machine's measured matmul rate: the baseline that step times are
stated against (``latency --baseline matmul``, the offline presets' share of the peak)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def matmul_gflops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """XLA's matmul throughput on the default device, best of ``repeats`` (n x n operands)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flops_per_token(cfg) -> float:
    """Matmul FLOPs per token outside attention (projections and MLP; logits are for one row)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * h + cfg.num_heads * h * d + 3 * d * f
    return 2.0 * per_layer * cfg.num_layers
