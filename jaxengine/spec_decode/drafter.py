"""The ``draft_model`` proposer: a smaller model of the same vocabulary proposes each decoding
row's draft on the device, from its own paged KV cache.

The draft's cache has the target's block size and as many blocks, and is indexed by the same
block tables, so the one KV cache manager allocates, shares, copies and swaps both (its bytes
per block are the target's plus the draft's, and the pool is sized for that). Two compiled
functions keep it in step:

- ``sync``: every target step runs the draft model on the same tokens (prompt chunks, decodes,
  the drafts being verified), so its cache holds every token the target computes; one
  executable per step bucket, compiled with the target's;
- ``propose``: after a step is sampled, for the rows the scheduler asked drafts of (the slots of
  their draft positions allocated with the step), n decode steps of the draft model from the
  row's last token, each writing its KV at the row's next position; one executable per row
  bucket, compiled at start-up. A row that wants fewer tokens writes its later steps into the
  null block.

The runner calls ``propose`` with ``ProposalRows`` read from its own input batch and hands the
drafts back in its output; the scheduler budgets them into the next step. A greedy proposal
puts all its mass on one token, so ``spec_decode.verify`` keeps the outputs the target's own.
Positions past a rejected draft hold stale KV that the next steps overwrite before anything
reads them (the scheduler rolls its computed tokens back).

``spec_decode.eagle_drafter`` builds the ``eagle3`` proposer on the same pieces (the cache, its
block moves, the per-bucket executables, ``propose``), with a sync that runs after the model's step.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.buckets import pick_bucket
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import feed_previous_tokens
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.mesh import kv_cache_sharding, place_model, replicated, shard_kernels
from jaxengine.sample.sampler import first_argmax, row_key

DRAFT_STREAM = 1 << 30      # a draft's draws: its request's stream, at positions of their own


class ProposalRows(NamedTuple):
    """The rows one proposal drafts for, one entry per row (the drafter pads them to its bucket)."""

    seq_ids: list[int]
    last_tokens: np.ndarray       # the row's last token: its draft follows it
    sample_rows: np.ndarray       # the sample row of the step just run that gave the last token
    positions: np.ndarray         # the last token's position
    tables: np.ndarray            # [rows, blocks] block tables, the slots of the draft positions allocated
    counts: np.ndarray            # the most draft tokens wanted
    temperature: np.ndarray       # the request's (a sampled draft is drawn at it)
    seeds: np.ndarray             # [rows, 2] the request's seed words
    sample_index: np.ndarray      # which of the request's samples


class Drafter:
    """The draft model, its cache and its compiled steps (see the module's docstring)."""

    layer_axis = True                # its caches [L, P, S, K*H] (a one-layer head's: [P, S, K*H])

    def __init__(self, model, model_config, *, k: int, num_gpu_blocks: int, block_size: int,
                 max_blocks_per_seq: int, row_buckets: list[int], dtype, make_mover: Callable, mesh=None,
                 on_compile: Callable[[str], None] = lambda what: None, sampled: bool = False) -> None:
        """``sampled``: a request that samples gets drafts drawn at its temperature, their
        distributions kept on the device for the step that verifies them (``draft_probs``).
        ``make_mover(block shapes, layers, dtype)``: the runner's block mover for its cache."""
        if mesh is not None:
            shard_kernels(model, mesh)
            place_model(model, mesh)
        self.k, self.block_size, self.max_blocks, self.sampled = k, block_size, max_blocks_per_seq, sampled
        self.row_buckets, self.mesh = row_buckets, mesh
        self.on_compile = on_compile
        self.kv_caches = init_kv_caches(model_config, num_gpu_blocks, block_size, dtype, layer_axis=self.layer_axis,
                                        sharding=None if mesh is None else self._kv_sharding(mesh, model_config))
        # Its steps compile against the caches' shapes (a compile must not touch the donated caches).
        self._kv_spec = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=c.sharding),
                                     self.kv_caches)
        self.mover = make_mover(model_config.kv_block_shapes(block_size), model_config.num_layers,
                                self.kv_caches[0].dtype)
        graphdef, self.state = nnx.split(model)
        self._placement = None if mesh is None else replicated(mesh)
        # Sampled drafts: each row's distributions [rows, k, V] of the latest proposal, and the
        # proposal row of each sequence in it.
        self.draft_probs = None if not sampled else jax.device_put(
            np.zeros((row_buckets[-1], k, model_config.vocab_size), np.float32), self._placement)
        self._proposal_rows: dict[int, int] = {}
        shardings = {} if mesh is None else {"out_shardings": self._sync_shardings(mesh, model_config)}
        self._sync = jax.jit(self._sync_fn(graphdef), donate_argnums=(1,), **shardings)
        propose_shardings = {} if mesh is None else {"out_shardings": (self._kv_sharding(mesh, model_config),
                                                                     replicated(mesh))}
        self._propose = jax.jit(self._propose_fn(graphdef), donate_argnums=(1, 2), **propose_shardings)
        self._sync_executables: dict[tuple, object] = {}
        self._propose_executables: dict[int, object] = {}
        self.num_proposals = 0
        self.propose_s = 0.0              # host time blocked on proposals (they run after their step)

    # ---- the compiled functions (the ``eagle3`` proposer has its own) ----
    def _sync_fn(self, graphdef) -> Callable:
        return _sync_fn(graphdef)

    def _propose_fn(self, graphdef) -> Callable:
        return _propose_fn(graphdef, self.k, self.block_size, self.sampled)

    def _kv_sharding(self, mesh, model_config):
        return kv_cache_sharding(mesh, model_config, layer_axis=self.layer_axis)

    def _sync_shardings(self, mesh, model_config):
        return self._kv_sharding(mesh, model_config)

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
            probs = None if self.draft_probs is None else jax.ShapeDtypeStruct(
                self.draft_probs.shape, self.draft_probs.dtype, sharding=self.draft_probs.sharding)
            executable = self._propose_executables[rows] = self._propose.lower(self.state, self._kv_spec, probs,
                                                                               *args).compile()
        return executable

    def compiled_programs(self) -> dict[str, object]:
        """Its steps, proposals and block moves compiled so far, by name."""
        return {**{f"step {bucket}": p for bucket, p in self._sync_executables.items()},
                **{f"proposal of {rows} rows": p for rows, p in self._propose_executables.items()},
                **{f"block {name}": p for name, p in self.mover.compiled_programs().items()}}

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

    def apply_moves(self, moves) -> None:
        self.kv_caches = self.mover.apply(self.kv_caches, moves.swap_out, moves.swap_in, moves.copy)

    def propose(self, rows: ProposalRows) -> list[list[int]]:
        """Each row's draft, up to its count of tokens, from its last token."""
        start = time.perf_counter()
        n, size = len(rows.seq_ids), pick_bucket(len(rows.seq_ids), self.row_buckets)
        arrays = self._row_arrays(size)
        for padded, given in zip(arrays, (self._starts(rows), *rows[3:])):
            padded[:n] = given
        executable = self._propose_executable(size)
        self.kv_caches, (drafts, probs) = executable(self.state, self.kv_caches, self.draft_probs,
                                                    *self._propose_args(*arrays))
        if self.sampled:
            self.draft_probs = probs
            self._proposal_rows = {seq_id: r for r, seq_id in enumerate(rows.seq_ids)}
        drafts = np.asarray(drafts)
        self.num_proposals += 1
        self.propose_s += time.perf_counter() - start
        return [drafts[r, :rows.counts[r]].tolist() for r in range(n)]

    def _starts(self, rows: ProposalRows) -> np.ndarray:
        """What each row's proposal starts from: its last token."""
        return rows.last_tokens

    def _row_arrays(self, rows: int) -> tuple[np.ndarray, ...]:
        """(starts, positions, block tables, counts, temperatures, seeds, sample indices) of
        ``rows`` rows, zero."""
        return (np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.zeros((rows, self.max_blocks), np.int32),
                np.zeros(rows, np.int32), np.zeros(rows, np.float32), np.zeros((rows, 2), np.uint32),
                np.zeros(rows, np.int32))

    def sampled_drafts(self, out, num_sample_rows: int) -> np.ndarray:
        """[2, R]: the draft token each sample row of ``out``'s step verifies (-1: none) and where
        its distribution is in ``draft_probs`` (row * k + position), for sampled drafts."""
        refs = np.zeros((2, num_sample_rows), np.int32)
        refs[0] = -1
        first = 0
        for i, seq_id in enumerate(out.seq_ids):
            draft, r = out.draft_token_ids.get(seq_id), self._proposal_rows.get(seq_id, -1)
            if draft and r >= 0:
                n = len(draft)
                refs[0, first:first + n], refs[1, first:first + n] = draft, r * self.k + np.arange(n)
            first += out.num_samples[i]
        return refs

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


def draft_slots(tables, positions, live, block_size: int):
    """Each row's KV slot at ``positions`` (a row not ``live`` this step: the null block)."""
    block = jnp.take_along_axis(tables, (positions // block_size)[:, None], axis=1)[:, 0]
    return jnp.where(live, block * block_size + positions % block_size, jnp.arange(len(positions)) % block_size)


def choose_drafts(logits, positions, sampling):
    """[B, V] -> each row's draft token [B], and with ``sampling`` (temperatures, seeds and
    sample indices [B]) the distribution a sampling row's token was drawn from [B, V] (its
    temperature's softmax; a greedy row's token is its argmax)."""
    greedy = first_argmax(logits)
    if sampling is None:
        return greedy, None
    temperature, seeds, sample_index = sampling
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    keys = jax.vmap(row_key)(seeds, sample_index, positions + DRAFT_STREAM)
    drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy), jax.nn.softmax(x, axis=-1)


def keep_probs(buffer, probs):
    """The proposal's distributions [B, k, V] into the donated buffer [rows, k, V] (in place)."""
    return jax.lax.dynamic_update_slice(buffer, probs, (0, 0, 0))


def _propose_fn(graphdef, k: int, block_size: int, sampled: bool):
    def propose(state, kv_caches, probs_buffer, tokens, positions, tables, counts, temperature, seeds, sample_index):
        """k steps, greedy or sampled; step i of a row with counts <= i writes into the null block."""
        model = nnx.merge(graphdef, state)
        rows = tokens.shape[0]
        sampling = (temperature, seeds, sample_index) if sampled else None

        def step(carry, i):
            kv_caches, tokens = carry
            pos = positions + i
            live = i < counts
            md = AttentionMetadata(jnp.where(live, pos, 0), draft_slots(tables, pos, live, block_size),
                                   jnp.arange(rows + 1, dtype=jnp.int32), jnp.where(live, pos + 1, 0), tables)
            hidden, kv_caches, _ = model.forward_with_expert_counts(tokens, kv_caches, md)
            nxt, probs = choose_drafts(model.compute_logits(hidden), pos + 1, sampling)
            return (kv_caches, nxt), (nxt, probs)

        (kv_caches, _), (drafts, probs) = jax.lax.scan(step, (kv_caches, tokens), jnp.arange(k))
        return kv_caches, (drafts.T, None if probs is None else keep_probs(probs_buffer, probs.transpose(1, 0, 2)))
    return propose
