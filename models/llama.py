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
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 rngs: nnx.Rngs) -> None:
        self.config = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, attention_fn, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, input_ids: jax.Array, kv_caches: list[KVCache],
                 md: AttentionMetadata) -> tuple[jax.Array, list[KVCache]]:
        """input_ids [T] -> final hidden states [T, D] and the updated caches."""
        inv_freq = rope_inv_freq(self.config)
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        new_caches = []
        for layer, cache in zip(self.layers, kv_caches):
            x, cache = layer(x, cache, md, inv_freq)
            new_caches.append(cache)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[R, D] -> [R, V] in f32, only for the rows the sampler needs."""
        if self.config.tie_word_embeddings:
            logits = jnp.einsum("rd,vd->rv", hidden, self.embed_tokens[...])
        else:
            logits = jnp.einsum("rd,dv->rv", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)


def init_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> list[KVCache]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
