"""Sizing the KV cache, and the block moves applied before a step (swap out, swap in, copy)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.buckets import pick_bucket


def bytes_per_block(elements_per_token: int, block_size: int, dtype) -> int:
    """A block of ``block_size`` tokens holding ``elements_per_token`` numbers each (all layers)."""
    return elements_per_token * block_size * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(2, budget_bytes // per_block)


# The caches are (k, v), each [L, P, *block] (latent attention: one array), or a one-layer head's
# [P, *block]; a move sees them as [L, P, *block] (blocks on axis 1) and returns them as they came.
def _layers(cache, block_ndim: int):
    return cache if cache.ndim == block_ndim + 2 else cache[None]


def _gather(kv_caches, idx, block_ndim: int):
    return tuple(_layers(c, block_ndim)[:, idx] for c in kv_caches)


def _scatter(kv_caches, idx, blocks, block_ndim: int):
    return tuple(_layers(c, block_ndim).at[:, idx].set(b).reshape(c.shape) for c, b in zip(kv_caches, blocks))


def _copy(kv_caches, src, dst, block_ndim: int):
    return tuple(_layers(c, block_ndim).at[:, dst].set(_layers(c, block_ndim)[:, src]).reshape(c.shape)
                 for c in kv_caches)


# The most (from, to) pairs one step's lists can hold, from the scheduler's and the KV cache
# manager's rules; the mover compiles every padded length up to these at start-up.
# - Copies: a copy-on-write happens when a scheduled sequence's next write lands in a block that
#   another sequence also holds. ``allocate_slots`` succeeds at most once per sequence per step
#   (a failed call changes nothing; a preempted victim's pending copies are dropped) and copies
#   at most the one block it writes into first: at most one copy per scheduled sequence, so at
#   most ``max_num_seqs``; each takes a free device block, so at most ``num_gpu_blocks - 1``
#   (block 0 is never handed out).
# - Swap out: the preempted groups' distinct blocks move into free host blocks
#   (``can_swap_out`` counts them against the free host pool, cumulatively over the step's
#   victims), so at most ``num_cpu_blocks``; they leave the device pool, so at most
#   ``num_gpu_blocks - 1``.
# - Swap in: the resumed groups' blocks leave the host pool for free device blocks: the same bound.
# - Without a host pool nothing is ever swapped, and no swap is compiled.
def max_block_moves(num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int) -> tuple[int, int]:
    """(most copies, most swapped blocks) of one step's move lists."""
    device = max(num_gpu_blocks - 1, 0)
    return min(max_num_seqs, device), min(num_cpu_blocks, device)


MOVE_KINDS = ("swap_out", "swap_in", "copy")
# The longest index list one move takes: a longer list goes in several moves of this length, so
# each kind compiles a handful of lengths (1, 4, 16, 64, 256) however large the pools are.
MOVE_CHUNK = 256


def move_buckets(most: int) -> list[int]:
    """The padded lengths of one kind's index lists: powers of 4 below ``min(most, MOVE_CHUNK)``,
    then that (none when ``most`` is 0). A list pads to at most 4x its length: moves are cheap
    next to a step, compiles are not."""
    top = min(most, MOVE_CHUNK)
    buckets, b = [], 1
    while b < top:
        buckets.append(b)
        b *= 4
    return buckets + [top] if top else []


def _jitted_move(kind: str, block_ndim: int, kv_sharding=None):
    """The jitted move of one kind; the caches it returns keep ``kv_sharding``."""
    if kind == "swap_out":
        return jax.jit(functools.partial(_gather, block_ndim=block_ndim))
    move = functools.partial(_scatter if kind == "swap_in" else _copy, block_ndim=block_ndim)
    return jax.jit(move, donate_argnums=(0,), out_shardings=kv_sharding)


class BlockMover:
    """Swap and copy whole blocks. Each kind's index lists go in chunks of at most ``MOVE_CHUNK``
    pairs, each padded with null-block pairs (0 -> 0) to a length of ``move_buckets`` up to the
    most one step can hold (``max_block_moves``), so their executables are few; ``compile_all``
    compiles them all, and any other length compiles on first use after telling ``on_compile``."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_shapes: tuple[tuple, ...], num_layers: int,
                 dtype, max_num_seqs: int, on_compile: Callable[[str], None] = lambda what: None, mesh=None) -> None:
        """``block_shapes``: one block's shape [S, K*H] in each array of the caches."""
        self.max_copies, self.max_swaps = max_block_moves(num_gpu_blocks, num_cpu_blocks, max_num_seqs)
        swaps = move_buckets(self.max_swaps)
        self.buckets = {"swap_out": swaps, "swap_in": swaps, "copy": move_buckets(self.max_copies)}
        self.host = tuple(np.zeros((num_layers, max(num_cpu_blocks, 1), *shape), jnp.dtype(dtype))
                          for shape in block_shapes)
        self.on_compile = on_compile
        self.num_layers = num_layers
        self.block_ndim = len(block_shapes[0])
        self.mesh = mesh               # the caches' mesh (the moves are compiled for their sharding)
        self._executables: dict[tuple[str, int], object] = {}     # (kind, index-list length) -> move

    def _chunks(self, kind: str, pairs: list[tuple[int, int]]):
        """(from, to, number of real pairs) per chunk, padded to its bucket."""
        buckets = self.buckets[kind]
        for start in range(0, len(pairs), MOVE_CHUNK):
            chunk = pairs[start:start + MOVE_CHUNK]
            n = len(chunk)
            # Beyond the compiled lengths (no step should get there): the chunk's own power of 4.
            size = pick_bucket(n, buckets if buckets and n <= buckets[-1] else move_buckets(MOVE_CHUNK))
            a = np.zeros(size, np.int32)
            b = np.zeros(size, np.int32)
            a[:n], b[:n] = zip(*chunk)
            yield a, b, n

    def apply(self, kv_caches, swap_out, swap_in, copies):
        for dev, host, n in self._chunks("swap_out", swap_out):    # every swap out before any swap in
            blocks = self._move(kv_caches, "swap_out", len(dev))(kv_caches, dev)
            for pool, part in zip(self.host, blocks):
                pool[:, host[:n]] = np.asarray(part)[:, :n]
        for host, dev, _ in self._chunks("swap_in", swap_in):      # padding pairs write into the null block
            blocks = tuple(pool[:, host] for pool in self.host)
            kv_caches = self._move(kv_caches, "swap_in", len(dev))(kv_caches, dev, blocks)
        # A copy's destination is a block freshly taken for it, never another copy's source: the
        # chunks' order does not matter.
        for src, dst, _ in self._chunks("copy", copies):
            kv_caches = self._move(kv_caches, "copy", len(src))(kv_caches, src, dst)
        return kv_caches

    def compiled_programs(self) -> dict[str, object]:
        """The moves compiled so far, by kind and length."""
        return {f"{kind} of {size}": move for (kind, size), move in self._executables.items()}

    def _move(self, kv_caches, kind: str, size: int):
        move = self._executables.get((kind, size))
        if move is None:
            self.on_compile(f"block {kind.replace('_', ' ')} of {size}")
            move = self._executables[(kind, size)] = self._compile(kv_caches, kind, size)
        return move

    def _compile(self, kv_caches, kind: str, size: int):
        replicated = None
        kv = (None,) * len(kv_caches)
        if self.mesh is not None:
            from jaxengine.models.mesh import replicated as replicated_on

            replicated, kv = replicated_on(self.mesh), tuple(c.sharding for c in kv_caches)   # as the caches lie
        idx = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=replicated)
        caches = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=s) for c, s in zip(kv_caches, kv))
        move = _jitted_move(kind, self.block_ndim, None if self.mesh is None else kv)
        if kind == "swap_out":
            return move.lower(caches, idx).compile()
        if kind == "swap_in":
            blocks = tuple(jax.ShapeDtypeStruct((self.num_layers, size, *c.shape[-self.block_ndim:]), c.dtype,
                                                sharding=s if s is None or c.ndim == self.block_ndim + 2 else
                                                jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec)))
                           for c, s in zip(kv_caches, kv))
            return move.lower(caches, idx, blocks).compile()
        return move.lower(caches, idx, idx).compile()

    def compile_all(self, kv_caches) -> int:
        """Compile every kind's moves for every padded length a step can produce; returns how many."""
        for kind in MOVE_KINDS:
            for size in self.buckets[kind]:
                self._executables[(kind, size)] = self._compile(kv_caches, kind, size)
        return sum(map(len, self.buckets.values()))
