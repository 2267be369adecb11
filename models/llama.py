"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import DecoderLayer, KVCache, RMSNorm, _param, rope_inv_freq


class LlamaForCausalLM(nnx.Module):
    """Layer weights are stacked ([L, ...]) and the layers run under ``lax.scan``: one layer body
    to compile, whatever the depth. The KV cache is (k, v), each [L, P, S, K, H]."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, attention_fn, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, input_ids: jax.Array, kv_caches: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """input_ids [T] -> final hidden states [T, D] and the updated caches."""
        inv_freq = rope_inv_freq(self.config)
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        graphdef, stacked = nnx.split(self.layers)

        def layer_step(x, per_layer):
            state, k, v = per_layer
            x, cache = nnx.merge(graphdef, state)(x, (k, v), md, inv_freq)
            return x, cache

        x, kv_caches = jax.lax.scan(layer_step, x, (stacked, *kv_caches))
        return self.norm(x), kv_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[R, D] -> [R, V] in f32, only for the rows the sampler needs."""
        if self.config.tie_word_embeddings:
            logits = jnp.einsum("rd,vd->rv", hidden, self.embed_tokens[...])
        else:
            logits = jnp.einsum("rd,dv->rv", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)


def init_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> KVCache:
    """(k, v), each [L, P, S, K, H]."""
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
