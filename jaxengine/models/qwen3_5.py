"""Qwen3.5 (text): a hybrid decoder. Three layers in four are Gated DeltaNet linear attention
(``models.gated_deltanet``), whose memory is a recurrent state per sequence; the fourth is gated
full attention (``layers.Attention`` with an output gate, q/k norms and RoPE on a quarter of each
head) over the paged KV cache. Every norm is zero-centred (x * (1 + w)).

The caches are (k, v, conv, state): the KV cache of the attention layers only ([G, P, S, K*H], as
``models.llama``'s), and the recurrent state pool, [Lr, slots, (K-1)*C] and [Lr, slots, Hv*dk*dv]
for the Lr recurrent layers, one slot per running sequence (``metadata.state_slots``; slot 0 is
the padding rows' and is never read). A row whose first token is its sequence's first starts from
zero states, whatever its slot held.

The layers run under ``lax.scan`` over the layer pattern's period (four layers for Qwen3.5), each
period unrolled, so every layer's kind is known when it is traced: no branch picks between the two
kinds, and each kind's weights stay stacked and are read in place by index."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.gated_deltanet import GatedDeltaNet
from jaxengine.models.layers import MLP, MODEL_AXIS, Attention, KVCache, RMSNorm, _param, is_dense_weight, \
    rope_inv_freq, run_mlp, weight
from jaxengine.models.llama import embed_with, logits_with, stacked
from jaxengine.models.moe import SparseMoeBlock


class HybridBlock(nnx.Module):
    """A layer's norms and MLP, dense or a mixture of experts (Qwen3.5-MoE: every layer's, with a
    gated shared expert); its token mixer lives in its kind's stack."""

    def __init__(self, cfg: ModelConfig, dtype, *, expert_parallel: bool = False, rngs: nnx.Rngs) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.mlp = SparseMoeBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=rngs) if cfg.is_moe else \
            MLP(cfg, dtype, rngs=rngs)


def layer_period(kinds: tuple[bool, ...]) -> int:
    """The shortest period of the layer pattern that divides the depth (the depth itself for none)."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


class Qwen3_5ForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 expert_parallel: bool = False, rngs: nnx.Rngs, **_) -> None:
        if cfg.dense_layers:
            raise ValueError(f"{cfg.architecture}: dense layers among sparse ones in a hybrid model are not supported")
        self.config = cfg
        if cfg.quant_spec("embed_tokens"):
            self.embed_tokens = weight(cfg, "embed_tokens", rngs, (cfg.hidden_size, cfg.vocab_size), dtype,
                                       (None, MODEL_AXIS))
        else:
            self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (MODEL_AXIS, None))
        self.layers = stacked(lambda r: HybridBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=r),
                              cfg.num_layers, rngs)
        self.attention_layers = stacked(lambda r: Attention(cfg, dtype, attention_fn, rngs=r), cfg.num_kv_layers, rngs)
        self.linear_layers = stacked(lambda r: GatedDeltaNet(cfg.linear_attention, dtype, rngs=r),
                                     len(cfg.linear_attention_layers), rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = weight(cfg, "lm_head", rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (None, MODEL_AXIS))
        self.dense_fn = dense

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
        expert over the layers [E] (E = 0 for a dense model), no auxiliary hidden states [T, 0])."""
        cfg = self.config
        if aux_layers:
            raise ValueError(f"{cfg.architecture}: no hidden states of its layers for a speculative head")
        if md.state_slots is None:
            raise ValueError(f"{cfg.architecture}: the step's metadata has no state slots (its recurrent layers need them)")
        inv_freq = rope_inv_freq(cfg)
        x = self.embed(input_ids)
        k_cache, v_cache, conv_pool, state_pool = kv_caches
        group_size, num_blocks, block_size = k_cache.shape[:3]
        grouped = md.block_tables.ndim == 3
        if group_size != (cfg.kv_group_size if grouped else cfg.num_kv_layers):
            raise ValueError(f"a KV cache of {group_size} layer places for {'grouped' if grouped else 'one'} block "
                             f"table(s) of a model with {cfg.num_kv_layers} attention layers")
        flat = tuple(c.reshape(group_size * num_blocks, block_size, -1) for c in (k_cache, v_cache))

        is_linear = tuple(i in cfg.linear_attention_layers for i in range(cfg.num_layers))
        period = layer_period(is_linear)
        # Within a period: each layer's index among its kind's layers of the period, and how many
        # of each kind a period holds (the stacks' index of layer p * period + q follows).
        rank = [sum(is_linear[j] == is_linear[q] for j in range(q)) for q in range(period)]
        per_period = {kind: sum(k == kind for k in is_linear[:period]) for kind in (True, False)}
        # Each attention layer's (group, place) in the KV cache, by its index in the attention stack
        kv_places = jnp.asarray(np.asarray(cfg.kv_layer_places, np.int32)[list(cfg.kv_layers)])

        block_def, block_dense, block_rest = nnx.split(self.layers, is_dense_weight, ...)
        attn_def, attn_dense, attn_rest = nnx.split(self.attention_layers, is_dense_weight, ...)
        lin_def, lin_dense, lin_rest = nnx.split(self.linear_layers, is_dense_weight, ...)

        def pick(rest, index):             # one layer's norms, biases and the like, from its stack
            return jax.tree.map(lambda a: a[index], rest)

        token_rows, keep, slots = md.token_rows, ~md.fresh_rows, md.state_slots
        conv_shape, state_shape = cfg.linear_attention.state_shapes()
        # The step's snapshots (prefix caching): each token's index among them (N: none).
        num_captures = 0 if md.snapshot_slots is None else md.snapshot_slots.shape[0]
        captures = None
        if num_captures:
            captures = jnp.full(token_rows.shape, num_captures, jnp.int32).at[md.snapshot_tokens].set(
                jnp.arange(num_captures, dtype=jnp.int32), mode="drop")

        def linear(h, states, j):
            """Layer j of the linear stack: its rows' states gathered from their slots (zeros where
            a row starts its sequence), and put back after."""
            conv_pool, state_pool = states
            mixer = nnx.merge(lin_def, lin_dense, pick(lin_rest, j))
            conv = jnp.where(keep[:, None], conv_pool[j, slots], 0).reshape(-1, *conv_shape)
            state = jnp.where(keep[:, None], state_pool[j, slots], 0).reshape(-1, *state_shape)
            out, conv, state, *snapshots = mixer(h, token_rows, conv, state, j, captures, num_captures)
            # The snapshots first: a snapshot taken after a row's last token is that row's state,
            # which XLA would otherwise read back from the pool between the two writes (a copy).
            for at, (conv_rows, state_rows) in ((md.snapshot_slots, snapshots or (None, None)), (slots, (conv, state))):
                if at is not None and conv_rows is not None:
                    conv_pool = conv_pool.at[j, at].set(conv_rows.reshape(len(at), -1))
                    state_pool = state_pool.at[j, at].set(state_rows.reshape(len(at), -1))
            return out, (conv_pool, state_pool)

        def attention(h, caches, j):
            """Layer j of the attention stack, on its group's tables at its place in the cache."""
            group, place = kv_places[j, 0], kv_places[j, 1]
            tables, slot_mapping = (md.block_tables[group], md.slot_mapping[group]) if grouped else \
                (md.block_tables, md.slot_mapping)
            offset = place * num_blocks
            md_layer = dataclasses.replace(md, block_tables=tables + offset,
                                           slot_mapping=slot_mapping + offset * block_size)
            return nnx.merge(attn_def, attn_dense, pick(attn_rest, j))(h, caches, md_layer, inv_freq, j)

        def run_period(carry, p):
            x, caches, states, counts = carry
            for q in range(period):                # unrolled: each layer's kind is known here
                layer = p * period + q
                block = nnx.merge(block_def, block_dense, pick(block_rest, layer))
                h = block.input_layernorm(x)
                j = p * per_period[is_linear[q]] + rank[q]
                if is_linear[q]:
                    out, states = linear(h, states, j)
                else:
                    out, caches = attention(h, caches, j)
                x = x + out
                out, routed = run_mlp(block.mlp, block.post_attention_layernorm(x), layer, md, cfg.num_experts)
                x, counts = x + out, counts + routed
            return (x, caches, states, counts), None

        counts = jnp.zeros((cfg.num_experts,), jnp.int32)
        (x, flat, states, counts), _ = jax.lax.scan(run_period, (x, flat, (conv_pool, state_pool), counts),
                                                    jnp.arange(cfg.num_layers // period))
        x = self.norm(x)
        k_cache, v_cache = (c.reshape(original.shape) for c, original in zip(flat, (k_cache, v_cache)))
        return x, (k_cache, v_cache, *states), counts, jnp.zeros((x.shape[0], 0), x.dtype)

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
