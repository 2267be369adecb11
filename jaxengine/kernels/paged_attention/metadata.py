"""Attention metadata for one step's flat ragged batch (T tokens, B requests, M blocks per row)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array        # [T] int32: each token's position in its sequence (padding: 0)
    slot_mapping: jax.Array     # [T] int32: cache slot (block * block_size + offset) each new K/V row goes to
    query_start_loc: jax.Array  # [B + 1] int32: row r's tokens are [query_start_loc[r], query_start_loc[r+1])
    seq_lens: jax.Array         # [B] int32: context length of each row after this step (padding rows: 0)
    block_tables: jax.Array     # [B, M] int32: each row's blocks (padding entries: the null block 0)
    # (A model whose layers keep KV in groups (``ModelConfig.kv_groups``) gets [G, T] and [G, B, M],
    # a slot mapping and tables per group, and hands each layer its group's: the kernels see [T], [B, M].)
    # With LoRA adapters (models.lora_weights): the tokens in adapter-slot order [T], each slot's
    # count [S] (the base model's tokens and the padding last, in no group), and each token's place
    # in that order [T]; None without adapters.
    lora_order: jax.Array | None = None
    lora_sizes: jax.Array | None = None
    lora_inverse: jax.Array | None = None
    # With recurrent layers (hybrid models): each row's state slot [B] (padding rows: the null
    # slot 0); None without them.
    state_slots: jax.Array | None = None
    # ... and the state snapshots the step takes for the prefix cache (``KVCacheManager.take_snapshots``):
    # [C] the slot each goes to (padding: 0) and [C] the token after which it is taken (padding: T).
    snapshot_slots: jax.Array | None = None
    snapshot_tokens: jax.Array | None = None

    @property
    def fresh_rows(self) -> jax.Array:
        """[B] whether each row's first token this step is its sequence's first (position 0)."""
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1]) == 0

    @property
    def token_rows(self) -> jax.Array:
        """[T] the row each token belongs to (B for padding tokens past the last row)."""
        import jax.numpy as jnp

        num_tokens = self.positions.shape[0]
        return jnp.searchsorted(self.query_start_loc[1:], jnp.arange(num_tokens), side="right")

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int]]], block_size: int, num_tokens: int,
              max_blocks: int, num_rows: int | None = None) -> "AttentionMetadata":
        """From (num_computed, num_new, block_table) per row; tokens padded to ``num_tokens`` and
        rows to ``num_rows`` (padding writes go to the null block and attend to nothing)."""
        num_rows = num_rows or len(rows)
        positions = np.zeros(num_tokens, np.int32)
        slots = np.zeros(num_tokens, np.int32)
        starts = np.zeros(num_rows + 1, np.int32)
        seq_lens = np.zeros(num_rows, np.int32)
        tables = np.zeros((num_rows, max_blocks), np.int32)
        t = 0
        for r, (num_computed, num_new, table) in enumerate(rows):
            pos = np.arange(num_computed, num_computed + num_new)
            positions[t:t + num_new] = pos
            slots[t:t + num_new] = np.asarray(table)[pos // block_size] * block_size + pos % block_size
            t += num_new
            seq_lens[r] = num_computed + num_new
            tables[r, :len(table)] = table
            starts[r + 1] = t
        starts[len(rows) + 1:] = t
        return cls(*(jax.numpy.asarray(a) for a in (positions, slots, starts, seq_lens, tables)))
