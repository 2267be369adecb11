"""Sizing the KV cache, and the block moves applied before a step (swap out, swap in, copy)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.buckets import pick_bucket, power_of_two_buckets


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(2, budget_bytes // per_block)


# The caches are (k, v), each [L, P, S, K, H]: blocks are indexed on axis 1.
def _gather(kv_caches, idx):
    return tuple(c[:, idx] for c in kv_caches)


def _scatter(kv_caches, idx, blocks):
    return tuple(c.at[:, idx].set(b) for c, b in zip(kv_caches, blocks))


def _copy(kv_caches, src, dst):
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_caches)


def _jitted_moves(kv_sharding=None) -> tuple:
    """(gather, scatter, copy); the caches the last two return keep ``kv_sharding``."""
    return (jax.jit(_gather), jax.jit(_scatter, donate_argnums=(0,), out_shardings=kv_sharding),
            jax.jit(_copy, donate_argnums=(0,), out_shardings=kv_sharding))


class BlockMover:
    """Swap and copy whole blocks. Index lists are padded to power-of-two lengths with null-block
    pairs (0 -> 0), so their executables are few; those up to a size are compiled ahead of time
    (``compile_up_to``) and any other compiles on first use after telling ``on_compile``."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, kv_shape: tuple, num_layers: int, dtype,
                 on_compile: Callable[[str], None] = lambda what: None, mesh=None) -> None:
        self.buckets = power_of_two_buckets(1, max(num_gpu_blocks, 1))
        self.host = np.zeros((num_layers, 2, max(num_cpu_blocks, 1), *kv_shape), jnp.dtype(dtype))
        self.on_compile = on_compile
        self.mesh = mesh               # the caches' mesh (the moves are compiled for their sharding)
        self._executables: dict[int, tuple] = {}     # index-list length -> (gather, scatter, copy)

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
            k, v = self._moves(kv_caches, len(dev))[0](kv_caches, dev)
            self.host[:, 0, host[:n]] = np.asarray(k)[:, :n]
            self.host[:, 1, host[:n]] = np.asarray(v)[:, :n]
        if swap_in:
            host, dev, _ = self._pad(swap_in)    # padding pairs write into the null block: harmless
            blocks = (self.host[:, 0, host], self.host[:, 1, host])
            kv_caches = self._moves(kv_caches, len(dev))[1](kv_caches, dev, blocks)
        if copies:
            src, dst, _ = self._pad(copies)
            kv_caches = self._moves(kv_caches, len(src))[2](kv_caches, src, dst)
        return kv_caches

    def _moves(self, kv_caches, size: int) -> tuple:
        moves = self._executables.get(size)
        if moves is None:
            self.on_compile(f"block moves of {size}")
            moves = self._executables[size] = self._compile(kv_caches, size)
        return moves

    def _compile(self, kv_caches, size: int) -> tuple:
        replicated = kv = None
        if self.mesh is not None:
            from jaxengine.models.mesh import kv_cache_sharding, replicated as replicated_on

            replicated, kv = replicated_on(self.mesh), kv_cache_sharding(self.mesh)
        idx = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated)
        caches = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=kv) for c in kv_caches)
        blocks = tuple(jax.ShapeDtypeStruct((c.shape[0], size, *c.shape[2:]), c.dtype, sharding=kv)
                       for c in kv_caches)
        gather, scatter, copy = _jitted_moves(kv)
        return (gather.lower(caches, idx).compile(), scatter.lower(caches, idx, blocks).compile(),
                copy.lower(caches, idx, idx).compile())

    def compile_up_to(self, kv_caches, max_pairs: int) -> None:
        """Compile the moves for every index-list bucket up to ``max_pairs``."""
        for size in self.buckets:
            if size > max_pairs:
                break
            self._executables[size] = self._compile(kv_caches, size)
