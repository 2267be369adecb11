"""What a hybrid model's layers share in one step (Qwen3.5, Nemotron-H): the attention layers' KV
cache and the recurrent layers' state pools, and the step's reads and writes of each.

The caches are (k, v, *states): the KV cache of the attention layers only ([G, P, S, K*H], as
``models.llama``'s), then the recurrent state pools, [Lr, slots, n] per state array
(``ModelConfig.state_slot_sizes``) for the Lr recurrent layers, one slot per running sequence
(``metadata.state_slots``; slot 0 is the padding rows' and is never read). A row whose first
token is its sequence's first starts from zero states, whatever its slot held.

The layers run under ``lax.scan`` over the layer pattern's period, each period unrolled, so every
layer's kind is known when it is traced: no branch picks between kinds, and each kind's weights
stay stacked and are read in place by index (``layer_period``, ``period_places``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import MODEL_AXIS, Attention, KVCache, RMSNorm, _param, is_dense_weight, rope_inv_freq, \
    weight
from jaxengine.models.llama import embed_with, logits_with, stacked


def layer_period(kinds: Sequence[Hashable]) -> int:
    """The shortest period of the layer pattern that divides the depth (the depth itself for none)."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def period_places(kinds: Sequence[Hashable]) -> tuple[int, list[int], dict]:
    """(the period, each of its layers' index among its kind's layers of the period, how many of
    each kind a period holds): layer p * period + q is layer p * count[kind] + rank[q] of its
    kind's stack."""
    period = layer_period(kinds)
    rank = [sum(kinds[j] == kinds[q] for j in range(q)) for q in range(period)]
    count = {kind: sum(k == kind for k in kinds[:period]) for kind in set(kinds)}
    return period, rank, count


def scan_periods(run_period, carry, trips: int, md: AttentionMetadata):
    """``run_period(carry, p) -> (carry, None)`` over periods p = 0 .. trips - 1: the carry after.
    A model of one period (Nemotron-H's patterns have none shorter than the model) runs it in a
    loop whose one trip XLA cannot count: XLA drops a loop it sees run once, and the straight code
    left wrote the last KV write into a second buffer for the step's result (a copy of the pool)."""
    if trips > 1:
        return jax.lax.scan(run_period, carry, jnp.arange(trips))[0]
    one = 1 + jnp.minimum(md.query_start_loc[0], 0)           # the first row starts at token 0

    def body(state):
        p, carry = state
        return p + 1, run_period(carry, p)[0]
    return jax.lax.while_loop(lambda state: state[0] < one, body, (jnp.int32(0), carry))[1]


def pick(rest, index):
    """One layer's norms, biases and the like, from its stack."""
    return jax.tree.map(lambda a: a[index], rest)


class HybridStep:
    """One step's attention and recurrent layers over the caches (``__call__``'s layers read
    their kind's stack at index j)."""

    def __init__(self, cfg: ModelConfig, kv_caches: KVCache, md: AttentionMetadata, attention_layers: nnx.Module,
                 linear_layers: nnx.Module) -> None:
        if md.state_slots is None:
            raise ValueError(f"{cfg.architecture}: the step's metadata has no state slots (its recurrent layers "
                             f"need them)")
        k_cache, v_cache, *states = kv_caches
        group_size, self.num_blocks, self.block_size = k_cache.shape[:3]
        self.grouped = md.block_tables.ndim == 3
        if group_size != (cfg.kv_group_size if self.grouped else cfg.num_kv_layers):
            raise ValueError(f"a KV cache of {group_size} layer places for {'grouped' if self.grouped else 'one'} "
                             f"block table(s) of a model with {cfg.num_kv_layers} attention layers")
        self.shapes = (k_cache.shape, v_cache.shape)
        self.kv = tuple(c.reshape(group_size * self.num_blocks, self.block_size, -1) for c in (k_cache, v_cache))
        self.states = tuple(states)
        self.md, self.inv_freq = md, rope_inv_freq(cfg)
        # Each attention layer's (group, place) in the KV cache, by its index in the attention stack
        self.kv_places = jnp.asarray(np.asarray(cfg.kv_layer_places, np.int32)[list(cfg.kv_layers)])
        self.attention_split = nnx.split(attention_layers, is_dense_weight, ...)
        self.linear_split = nnx.split(linear_layers, is_dense_weight, ...)
        self.keep = ~md.fresh_rows
        # A decode step (no row with more than one token) runs each recurrent layer's tokens at once
        self.one_token_rows = jnp.all(jnp.diff(md.query_start_loc) <= 1)
        self.state_shapes = cfg.linear_attention.state_shapes() if cfg.is_hybrid else ()
        # The step's snapshots (prefix caching): each token's index among them (N: none).
        self.num_captures = 0 if md.snapshot_slots is None else md.snapshot_slots.shape[0]
        self.captures = None
        if self.num_captures:
            self.captures = jnp.full(md.token_rows.shape, self.num_captures, jnp.int32).at[md.snapshot_tokens].set(
                jnp.arange(self.num_captures, dtype=jnp.int32), mode="drop")

    def linear(self, h: jax.Array, states: tuple, j) -> tuple[jax.Array, tuple]:
        """Layer j of the recurrent stack: its rows' states gathered from their slots (zeros where a
        row starts its sequence), and put back after."""
        md, (graph, dense, rest) = self.md, self.linear_split
        conv_pool, state_pool = states
        slots = md.state_slots
        mixer = nnx.merge(graph, dense, pick(rest, j))
        conv_shape, state_shape = self.state_shapes
        conv = jnp.where(self.keep[:, None], conv_pool[j, slots], 0).reshape(-1, *conv_shape)
        state = jnp.where(self.keep[:, None], state_pool[j, slots], 0).reshape(-1, *state_shape)
        out, conv, state, *snapshots = mixer(h, md.token_rows, conv, state, j, self.captures, self.num_captures,
                                             self.one_token_rows, md.query_start_loc[-1])
        # The snapshots first: a snapshot taken after a row's last token is that row's state,
        # which XLA would otherwise read back from the pool between the two writes (a copy).
        for at, (conv_rows, state_rows) in ((md.snapshot_slots, snapshots or (None, None)), (slots, (conv, state))):
            if at is not None and conv_rows is not None:
                conv_pool = conv_pool.at[j, at].set(conv_rows.reshape(len(at), -1))
                state_pool = state_pool.at[j, at].set(state_rows.reshape(len(at), -1))
        return out, (conv_pool, state_pool)

    def attention(self, h: jax.Array, caches: KVCache, j) -> tuple[jax.Array, KVCache]:
        """Layer j of the attention stack, on its group's tables at its place in the cache."""
        md, (graph, dense, rest) = self.md, self.attention_split
        group, place = self.kv_places[j, 0], self.kv_places[j, 1]
        tables, slot_mapping = (md.block_tables[group], md.slot_mapping[group]) if self.grouped else \
            (md.block_tables, md.slot_mapping)
        offset = place * self.num_blocks
        md_layer = dataclasses.replace(md, block_tables=tables + offset,
                                       slot_mapping=slot_mapping + offset * self.block_size)
        return nnx.merge(graph, dense, pick(rest, j))(h, caches, md_layer, self.inv_freq, j)

    def caches(self, kv: KVCache, states: tuple) -> KVCache:
        """The step's caches after it, in the caller's shapes."""
        return (*(c.reshape(shape) for c, shape in zip(kv, self.shapes)), *states)


class HybridDecoder(nnx.Module):
    """What the hybrid models share around their layers (Qwen3.5, Nemotron-H): the embedding, the
    attention and recurrent stacks, the final norm and LM head, and the entry points the runner
    calls. Each model adds its own stacks and runs its layers (``run_layers``)."""

    def __init__(self, cfg: ModelConfig, dtype, attention_fn: Callable, mixer: type, rngs: nnx.Rngs) -> None:
        """``mixer``: the recurrent layers' class, built from ``cfg.linear_attention``."""
        self.config = cfg
        if cfg.quant_spec("embed_tokens"):
            self.embed_tokens = weight(cfg, "embed_tokens", rngs, (cfg.hidden_size, cfg.vocab_size), dtype,
                                       (None, MODEL_AXIS))
        else:
            self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (MODEL_AXIS, None))
        self.attention_layers = stacked(lambda r: Attention(cfg, dtype, attention_fn, rngs=r), cfg.num_kv_layers, rngs)
        self.linear_layers = stacked(lambda r: mixer(cfg.linear_attention, dtype, rngs=r),
                                     len(cfg.linear_attention_layers), rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = weight(cfg, "lm_head", rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (None, MODEL_AXIS))
        self.dense_fn = dense

    def run_layers(self, step: HybridStep, x: jax.Array, md: AttentionMetadata) -> tuple:
        """The embedded tokens [T, D] through the layers -> (x, the KV arrays, the state pools,
        the tokens routed to each expert [E])."""
        raise NotImplementedError

    def __call__(self, input_ids: jax.Array, kv_caches: KVCache, md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        hidden, kv_caches, _ = self.forward_with_expert_counts(input_ids, kv_caches, md)
        return hidden, kv_caches

    def forward_with_expert_counts(self, input_ids: jax.Array, kv_caches: KVCache,
                                   md: AttentionMetadata) -> tuple[jax.Array, KVCache, jax.Array]:
        hidden, kv_caches, counts, _ = self.forward_with_aux_hidden(input_ids, kv_caches, md)
        return hidden, kv_caches, counts

    def forward_with_aux_hidden(self, input_ids: jax.Array, kv_caches: KVCache, md: AttentionMetadata,
                                aux_layers: tuple[int, ...] = ()) -> tuple[jax.Array, KVCache, jax.Array, jax.Array]:
        """input_ids [T] -> (final hidden states [T, D], the caches, the tokens routed to each
        expert over the layers [E] (E = 0 without experts), no auxiliary hidden states [T, 0])."""
        if aux_layers:
            raise ValueError(f"{self.config.architecture}: no hidden states of its layers for a speculative head")
        step = HybridStep(self.config, kv_caches, md, self.attention_layers, self.linear_layers)
        x, kv, states, counts = self.run_layers(step, self.embed(input_ids), md)
        return self.norm(x), step.caches(kv, states), counts, jnp.zeros((x.shape[0], 0), x.dtype)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        return embed_with(self.embed_tokens, input_ids)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return logits_with(self, hidden)


def init_state_pools(cfg: ModelConfig, num_slots: int, sharding: jax.sharding.Sharding | None = None
                     ) -> tuple[jax.Array, ...]:
    """The recurrent state pools of ``cfg``'s recurrent layers, zeros: [Lr, slots, n] per state
    array (``ModelConfig.state_slot_sizes``), float32; with a ``sharding``, created in place."""
    shapes = [(len(cfg.linear_attention_layers), num_slots, n) for n in cfg.state_slot_sizes()]
    return jax.jit(lambda: tuple(jnp.zeros(shape, jnp.float32) for shape in shapes), out_shardings=sharding)()
