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

from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.gated_deltanet import GatedDeltaNet
from jaxengine.models.hybrid import HybridDecoder, HybridStep, period_places, pick, scan_periods
from jaxengine.models.layers import MLP, RMSNorm, is_dense_weight, run_mlp
from jaxengine.models.llama import stacked
from jaxengine.models.moe import SparseMoeBlock


class HybridBlock(nnx.Module):
    """A layer's norms and MLP, dense or a mixture of experts (Qwen3.5-MoE: every layer's, with a
    gated shared expert); its token mixer lives in its kind's stack."""

    def __init__(self, cfg: ModelConfig, dtype, *, expert_parallel: bool = False, rngs: nnx.Rngs) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.mlp = SparseMoeBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=rngs) if cfg.is_moe else \
            MLP(cfg, dtype, rngs=rngs)


class Qwen3_5ForCausalLM(HybridDecoder):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 expert_parallel: bool = False, rngs: nnx.Rngs, **_) -> None:
        if cfg.dense_layers:
            raise ValueError(f"{cfg.architecture}: dense layers among sparse ones in a hybrid model are not supported")
        super().__init__(cfg, dtype, attention_fn, GatedDeltaNet, rngs)
        self.layers = stacked(lambda r: HybridBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=r),
                              cfg.num_layers, rngs)

    def run_layers(self, step: HybridStep, x: jax.Array, md: AttentionMetadata) -> tuple:
        cfg = self.config
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
        return scan_periods(run_period, (x, step.kv, step.states, counts), cfg.num_layers // period, md)
