"""Qwen3.5 (text): a hybrid decoder. Three layers in four are Gated DeltaNet linear attention
(``models.gated_deltanet``), whose memory is a recurrent state per sequence; the fourth is gated
full attention (``layers.Attention`` with an output gate, q/k norms and RoPE on a quarter of each
head) over the paged KV cache. Every norm is zero-centred (x * (1 + w)).

The caches are (k, v, conv, state): the KV cache of the attention layers and the recurrent state
pools, [Lr, slots, (K-1)*C] and [Lr, slots, Hv*dk*dv] (``models.hybrid``). The layers run under a
scan over the layer pattern's period (four layers for Qwen3.5), each period unrolled."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.gated_deltanet import GatedDeltaNet
from jaxengine.models.hybrid import HybridStep, period_places, pick, scan_periods
from jaxengine.models.layers import MLP, MODEL_AXIS, Attention, KVCache, RMSNorm, _param, is_dense_weight, \
    run_mlp, weight
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
        step = HybridStep(cfg, kv_caches, md, self.attention_layers, self.linear_layers)
        x = self.embed(input_ids)
        kinds = tuple(i in cfg.linear_attention_layers for i in range(cfg.num_layers))
        period, rank, per_period = period_places(kinds)
        block_def, block_dense, block_rest = nnx.split(self.layers, is_dense_weight, ...)

        def run_period(carry, p):
            x, caches, states, counts = carry
            for q in range(period):                # unrolled: each layer's kind is known here
                layer = p * period + q
                block = nnx.merge(block_def, block_dense, pick(block_rest, layer))
                h = block.input_layernorm(x)
                j = p * per_period[kinds[q]] + rank[q]
                if kinds[q]:
                    out, states = step.linear(h, states, j)
                else:
                    out, caches = step.attention(h, caches, j)
                x = x + out
                out, routed = run_mlp(block.mlp, block.post_attention_layernorm(x), layer, md, cfg.num_experts)
                x, counts = x + out, counts + routed
            return (x, caches, states, counts), None

        counts = jnp.zeros((cfg.num_experts,), jnp.int32)
        x, kv, states, counts = scan_periods(run_period, (x, step.kv, step.states, counts), cfg.num_layers // period,
                                             md)
        return self.norm(x), step.caches(kv, states), counts, jnp.zeros((x.shape[0], 0), x.dtype)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        return embed_with(self.embed_tokens, input_ids)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return logits_with(self, hidden)

