"""The shared Llama-family layers (Flax NNX). Einsum letters: T tokens, N query heads, K KV heads,
H head size, D model width, F MLP width, V vocab."""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata, write_kv
from jaxengine.models.config import ModelConfig

KVCache = tuple[jax.Array, jax.Array]       # (k, v); a layer sees [P, S, K, H] (all layers flattened: [L*P, S, K, H])


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)                     # normalise in f32, as the reference does
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama 3 scaling when configured (host-side constant)."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    sc = cfg.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate [T, n, H] by position; the half-split (rotate_half) layout of Hugging Face models."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]      # [T, H/2]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, attention_fn: Callable, *, rngs: nnx.Rngs) -> None:
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _param(rngs, (d, n, h), dtype)
        self.k_proj = _param(rngs, (d, k, h), dtype)
        self.v_proj = _param(rngs, (d, k, h), dtype)
        self.o_proj = _param(rngs, (n, h, d), dtype)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, h), dtype))
            self.k_bias = nnx.Param(jnp.zeros((k, h), dtype))
            self.v_bias = nnx.Param(jnp.zeros((k, h), dtype))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.cfg = cfg
        self.attention_fn = attention_fn
        self.kv_write_fn = write_kv       # the XLA scatter; kernels.paged_attention.kv_write has a Pallas one

    def __call__(self, x: jax.Array, cache: KVCache, md: AttentionMetadata,
                 inv_freq: np.ndarray) -> tuple[jax.Array, KVCache]:
        cfg = self.cfg
        q = jnp.einsum("td,dnh->tnh", x, self.q_proj[...])
        k = jnp.einsum("td,dkh->tkh", x, self.k_proj[...])
        v = jnp.einsum("td,dkh->tkh", x, self.v_proj[...])
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, md.positions, inv_freq), apply_rope(k, md.positions, inv_freq)
        cache = self.kv_write_fn(*cache, k, v, md.slot_mapping)     # writes precede the reads of this step
        o = self.attention_fn(q, *cache, md, scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window)
        return jnp.einsum("tnh,nhd->td", o, self.o_proj[...]), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs) -> None:
        self.gate_proj = _param(rngs, (cfg.hidden_size, cfg.intermediate_size), dtype)
        self.up_proj = _param(rngs, (cfg.hidden_size, cfg.intermediate_size), dtype)
        self.down_proj = _param(rngs, (cfg.intermediate_size, cfg.hidden_size), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jax.nn.silu(jnp.einsum("td,df->tf", x, self.gate_proj[...]))
        up = jnp.einsum("td,df->tf", x, self.up_proj[...])
        return jnp.einsum("tf,fd->td", gate * up, self.down_proj[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, attention_fn: Callable, *, rngs: nnx.Rngs) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, attention_fn, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cache: KVCache, md: AttentionMetadata,
                 inv_freq: np.ndarray) -> tuple[jax.Array, KVCache]:
        attn, cache = self.self_attn(self.input_layernorm(x), cache, md, inv_freq)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache
