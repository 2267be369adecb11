"""The ``draft_model`` proposer: a smaller model of the same vocabulary proposes each decoding
row's draft on the device, greedily, from its own paged KV cache.

The draft's cache has the target's block size and as many blocks, and is indexed by the same
block tables, so the one KV cache manager allocates, shares, copies and swaps both (its bytes
per block are the target's plus the draft's, and the pool is sized for that). Two compiled
functions keep it in step:

- ``sync``: every target step runs the draft model on the same tokens (prompt chunks, decodes,
  the drafts being verified), so its cache holds every token the target computes; one
  executable per step bucket, compiled with the target's;
- ``propose``: for the rows the scheduler gives it (each with its draft slots already allocated),
  n greedy decode steps of the draft model from the row's last token, each writing its KV at
  the row's next position; one executable per row bucket, compiled at start-up. A row that wants
  fewer tokens writes its later steps into the null block.

A greedy proposal puts all its mass on one token, so ``spec_decode.verify`` keeps the outputs
the target's own. Positions past a rejected draft hold stale KV that the next steps overwrite
before anything reads them (the scheduler rolls its computed tokens back).

``runner.eagle_drafter`` builds the ``eagle3`` proposer on the same pieces (the cache, its block
moves, the per-bucket executables, ``propose_rows``), with a sync that runs after the model's step.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import feed_previous_tokens
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.mesh import kv_cache_sharding, place_model, replicated, shard_kernels
from jaxengine.runner.buckets import pick_bucket
from jaxengine.runner.kv_cache import BlockMover
from jaxengine.sample.sampler import first_argmax


class Drafter:
    """The draft model, its cache and its compiled steps (see the module's docstring)."""

    needs_slots = True               # the scheduler allocates a draft's KV slots before proposing it

    def __init__(self, model, model_config, *, k: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 max_blocks_per_seq: int, row_buckets: list[int], max_num_seqs: int, dtype, mesh=None,
                 on_compile: Callable[[str], None] = lambda what: None) -> None:
        if mesh is not None:
            shard_kernels(model, mesh)
            place_model(model, mesh)
        self.k, self.block_size, self.max_blocks = k, block_size, max_blocks_per_seq
        self.row_buckets, self.mesh = row_buckets, mesh
        self.on_compile = on_compile
        self.kv_caches = init_kv_caches(model_config, num_gpu_blocks, block_size, dtype,
                                        sharding=None if mesh is None else kv_cache_sharding(mesh))
        # Its steps compile against the caches' shapes (a compile must not touch the donated caches).
        self._kv_spec = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=c.sharding),
                                     self.kv_caches)
        kv_shape = (block_size, model_config.num_kv_heads, model_config.head_dim)
        self.mover = BlockMover(num_gpu_blocks, num_cpu_blocks, kv_shape, model_config.num_layers, dtype,
                                max_num_seqs, on_compile=on_compile, mesh=mesh)
        graphdef, self.state = nnx.split(model)
        shardings = {} if mesh is None else {"out_shardings": self._sync_shardings(mesh)}
        self._sync = jax.jit(self._sync_fn(graphdef), donate_argnums=(1,), **shardings)
        propose_shardings = {} if mesh is None else {"out_shardings": (kv_cache_sharding(mesh), replicated(mesh))}
        self._propose = jax.jit(self._propose_fn(graphdef), donate_argnums=(1,), **propose_shardings)
        self._placement = None if mesh is None else replicated(mesh)
        self._sync_executables: dict[tuple, object] = {}
        self._propose_executables: dict[int, object] = {}
        self.num_proposals = 0
        self.propose_s = 0.0              # host time blocked on proposals (they run before their step)

    # ---- the compiled functions (the ``eagle3`` proposer has its own) ----
    def _sync_fn(self, graphdef) -> Callable:
        return _sync_fn(graphdef)

    def _propose_fn(self, graphdef) -> Callable:
        return _propose_fn(graphdef, self.k, self.block_size)

    @staticmethod
    def _sync_shardings(mesh):
        return kv_cache_sharding(mesh)

    # ---- compilation ----
    def compile_step(self, bucket: tuple[int, int], inputs, ids, step_outputs) -> None:
        """The sync of one step bucket (``step_outputs``: the model step's outputs, as shapes)."""
        self._sync_executables[bucket] = self._sync.lower(self.state, self._kv_spec, ids, inputs.attention).compile()

    def compile_proposals(self) -> None:
        """Every row bucket's proposal step."""
        for rows in self.row_buckets:
            self._propose_executable(rows, compiling=True)

    def _propose_executable(self, rows: int, compiling: bool = False):
        executable = self._propose_executables.get(rows)
        if executable is None:
            if not compiling:
                self.on_compile(f"draft proposal for {rows} rows")
            args = self._propose_args(*self._row_arrays(rows))
            executable = self._propose_executables[rows] = self._propose.lower(self.state, self._kv_spec,
                                                                               *args).compile()
        return executable

    # ---- each step ----
    def _sync_executable(self, inputs, ids, step_outputs, what: str):
        """The sync of the step's bucket (compiled now if it has none, counted as after start-up)."""
        bucket = inputs.bucket
        executable = self._sync_executables.get(bucket)
        if executable is None:
            self.on_compile(f"{what} step bucket {bucket}")
            self.compile_step(bucket, inputs, ids, step_outputs)
            executable = self._sync_executables[bucket]
        return executable

    def before_step(self, inputs, ids) -> None:
        """The draft model over the target step's tokens (its cache gets their KV)."""
        executable = self._sync_executable(inputs, ids, None, "draft")
        self.kv_caches = executable(self.state, self.kv_caches, ids, inputs.attention)

    def after_step(self, inputs, step_outputs) -> None:
        """What follows the model's step on the device (the ``eagle3`` head's sync)."""

    def note_verified(self, out, first_sample_rows, sampled: list[list[int]]) -> None:
        """A step's verified tokens (the ``eagle3`` head drafts on from them)."""

    def apply_moves(self, moves) -> None:
        self.kv_caches = self.mover.apply(self.kv_caches, moves.swap_out, moves.swap_in, moves.copy)

    def propose_rows(self, rows: list[tuple[object, int]]) -> list[list[int]]:
        """Each (sequence, n) row's n draft tokens, greedy, from its last token (its block table
        holds the slots of its next n positions)."""
        start = time.perf_counter()
        size = pick_bucket(len(rows), self.row_buckets)
        starts, positions, tables, counts = self._row_arrays(size)
        for r, (seq, n) in enumerate(rows):
            starts[r], positions[r], counts[r] = self._row_start(seq), len(seq.token_ids) - 1, n
            tables[r, :len(seq.block_table)] = seq.block_table
        counts[:len(rows)] = np.where(starts[:len(rows)] >= 0, counts[:len(rows)], 0)
        executable = self._propose_executable(size)
        self.kv_caches, drafts = executable(self.state, self.kv_caches,
                                            *self._propose_args(np.maximum(starts, 0), positions, tables, counts))
        drafts = np.asarray(drafts)
        self.num_proposals += 1
        self.propose_s += time.perf_counter() - start
        return [drafts[r, :counts[r]].tolist() for r in range(len(rows))]

    def _row_start(self, seq) -> int:
        """What a row's proposal starts from: its last token (-1: it cannot be proposed for)."""
        return seq.token_ids[-1]

    def _row_arrays(self, rows: int) -> tuple[np.ndarray, ...]:
        """(starts, positions, block tables, counts) of ``rows`` rows, zero."""
        return (np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.zeros((rows, self.max_blocks), np.int32),
                np.zeros(rows, np.int32))

    def _propose_args(self, *arrays) -> tuple:
        return tuple(jax.device_put(a, self._placement) for a in arrays)


def _sync_fn(graphdef):
    def sync(state, kv_caches, ids, md: AttentionMetadata):
        if isinstance(ids, tuple):
            ids = feed_previous_tokens(*ids)
        model = nnx.merge(graphdef, state)
        _, kv_caches, _ = model.forward_with_expert_counts(ids, kv_caches, md)
        return kv_caches
    return sync


def _propose_fn(graphdef, k: int, block_size: int):
    def propose(state, kv_caches, tokens, positions, tables, counts):
        """k greedy steps; step i of a row with counts <= i writes into the null block."""
        model = nnx.merge(graphdef, state)
        rows = tokens.shape[0]
        row_index = jnp.arange(rows)

        def step(carry, i):
            kv_caches, tokens = carry
            pos = positions + i
            live = i < counts
            block = jnp.take_along_axis(tables, (pos // block_size)[:, None], axis=1)[:, 0]
            slots = jnp.where(live, block * block_size + pos % block_size, row_index % block_size)
            md = AttentionMetadata(jnp.where(live, pos, 0), slots, jnp.arange(rows + 1, dtype=jnp.int32),
                                   jnp.where(live, pos + 1, 0), tables)
            hidden, kv_caches, _ = model.forward_with_expert_counts(tokens, kv_caches, md)
            nxt = first_argmax(model.compute_logits(hidden))
            return (kv_caches, nxt), nxt

        (kv_caches, _), drafts = jax.lax.scan(step, (kv_caches, tokens), jnp.arange(k))
        return kv_caches, drafts.T
    return propose
