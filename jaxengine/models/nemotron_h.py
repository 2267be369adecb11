"""Nemotron-H: a hybrid decoder whose blocks are one part each, in the order its config lists them:
Mamba-2 (``models.mamba2``, a recurrent state per sequence), attention (``layers.Attention``, no
positions of its own: no RoPE), a squared-ReLU MLP, or a mixture of experts (squared-ReLU experts
without a gate, DeepSeek-V3's grouped sigmoid router, an ungated shared expert, and in some models
a narrower latent width the experts run in). One RMS norm before each part, a residual after.

The caches and the scan over the layer pattern's period are ``models.hybrid``'s. Nemotron-H's
published patterns have no period shorter than the model ("M-M-M-M*-M-M-..."): the scan then runs
once over the whole model, unrolled."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.hybrid import HybridDecoder, HybridStep, period_places, pick, scan_periods
from jaxengine.models.layers import MLP, RMSNorm, is_dense_weight, run_mlp
from jaxengine.models.llama import stacked
from jaxengine.models.mamba2 import Mamba2
from jaxengine.models.moe import SparseMoeBlock

MAMBA, ATTENTION, MLP_BLOCK, MOE = "M", "*", "-", "E"      # the kinds, as NVIDIA's patterns write them


class NormOnly(nnx.Module):
    """A block's norm; its one part lives in its kind's stack."""

    def __init__(self, cfg: ModelConfig, dtype) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's kind (M, *, - or E)."""
    def kind(i: int) -> str:
        if i in cfg.linear_attention_layers:
            return MAMBA
        if i in cfg.kv_layers:
            return ATTENTION
        return MOE if i in cfg.sparse_layers else MLP_BLOCK
    return tuple(kind(i) for i in range(cfg.num_layers))


class NemotronHForCausalLM(HybridDecoder):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 expert_parallel: bool = False, rngs: nnx.Rngs, **_) -> None:
        super().__init__(cfg, dtype, attention_fn, Mamba2, rngs)
        self.layers = stacked(lambda r: NormOnly(cfg, dtype), cfg.num_layers, rngs)
        if cfg.dense_layers:
            self.dense_mlp = stacked(lambda r: MLP(cfg, dtype, rngs=r), len(cfg.dense_layers), rngs)
        if cfg.sparse_layers:
            self.sparse_mlp = stacked(lambda r: SparseMoeBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=r),
                                      len(cfg.sparse_layers), rngs)

    def run_layers(self, step: HybridStep, x: jax.Array, md: AttentionMetadata) -> tuple:
        cfg = self.config
        kinds = layer_kinds(cfg)
        period, rank, per_period = period_places(kinds)
        norms = nnx.split(self.layers, is_dense_weight, ...)
        mlps = {kind: nnx.split(getattr(self, name), is_dense_weight, ...)
                for kind, name in ((MLP_BLOCK, "dense_mlp"), (MOE, "sparse_mlp")) if hasattr(self, name)}

        def run_period(carry, p):
            x, caches, states, counts = carry
            for q in range(period):                # unrolled: each layer's kind is known here
                kind, j = kinds[q], p * per_period[kinds[q]] + rank[q]
                graph, dense_weights, rest = norms
                h = nnx.merge(graph, dense_weights, pick(rest, p * period + q)).input_layernorm(x)
                if kind == MAMBA:
                    out, states = step.linear(h, states, j)
                elif kind == ATTENTION:
                    out, caches = step.attention(h, caches, j)
                else:
                    graph, dense_weights, rest = mlps[kind]
                    out, routed = run_mlp(nnx.merge(graph, dense_weights, pick(rest, j)), h, j, md, cfg.num_experts)
                    counts = counts + routed
                x = x + out
            return (x, caches, states, counts), None

        counts = jnp.zeros((cfg.num_experts,), jnp.int32)
        return scan_periods(run_period, (x, step.kv, step.states, counts), cfg.num_layers // period, md)
