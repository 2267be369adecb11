"""Sizing the KV cache, and the block moves applied before a step (swap out, swap in, copy)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.buckets import pick_bucket, power_of_two_buckets


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(2, budget_bytes // per_block)


# The caches are (k, v), each [L, P, S, K, H]: blocks are indexed on axis 1.
@jax.jit
def _gather_blocks(kv_caches, idx):
    return tuple(c[:, idx] for c in kv_caches)


def _scatter(kv_caches, idx, blocks):
    return tuple(c.at[:, idx].set(b) for c, b in zip(kv_caches, blocks))


_scatter_blocks = jax.jit(_scatter, donate_argnums=(0,))


def _copy(kv_caches, src, dst):
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_caches)


_copy_blocks = jax.jit(_copy, donate_argnums=(0,))


class BlockMover:
    """Swap and copy whole blocks. Index lists are padded to power-of-two lengths with null-block
    pairs (0 -> 0), so their compilations stay bounded and are done at start-up."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, kv_shape: tuple, num_layers: int, dtype) -> None:
        self.buckets = power_of_two_buckets(1, max(num_gpu_blocks, 1))
        self.host = np.zeros((num_layers, 2, max(num_cpu_blocks, 1), *kv_shape), jnp.dtype(dtype))

    def _pad(self, pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, int]:
        n = len(pairs)
        size = pick_bucket(n, self.buckets)
        a = np.zeros(size, np.int32)
        b = np.zeros(size, np.int32)
        a[:n], b[:n] = zip(*pairs)
        return a, b, n

    def apply(self, kv_caches, swap_out, swap_in, copies):
        if swap_out:
            dev, host, n = self._pad(swap_out)
            k, v = _gather_blocks(kv_caches, dev)
            self.host[:, 0, host[:n]] = np.asarray(k)[:, :n]
            self.host[:, 1, host[:n]] = np.asarray(v)[:, :n]
        if swap_in:
            host, dev, _ = self._pad(swap_in)    # padding pairs write into the null block: harmless
            kv_caches = _scatter_blocks(kv_caches, dev, (self.host[:, 0, host], self.host[:, 1, host]))
        if copies:
            src, dst, _ = self._pad(copies)
            kv_caches = _copy_blocks(kv_caches, src, dst)
        return kv_caches

    def warm_up(self, kv_caches, max_pairs: int):
        """Compile the move kernels for every index-list bucket up to ``max_pairs``."""
        for size in self.buckets:
            if size > max_pairs:
                break
            zeros = np.zeros(size, np.int32)
            _gather_blocks(kv_caches, zeros)
            blocks = tuple(np.zeros((c.shape[0], size, *c.shape[2:]), c.dtype) for c in kv_caches)
            kv_caches = _scatter_blocks(kv_caches, zeros, blocks)
            kv_caches = _copy_blocks(kv_caches, zeros, zeros)
        return kv_caches

    @staticmethod
    def cache_sizes() -> int:
        return _gather_blocks._cache_size() + _scatter_blocks._cache_size() + _copy_blocks._cache_size()
