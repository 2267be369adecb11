"""DeepSeek-V3's multi-head latent attention as a layer of the Llama-family decoder.

Each token's hidden state goes down to a latent of ``kv_lora_rank`` (normalised) and one rotary
key of ``qk_rope_head_dim`` shared by the heads; the KV cache keeps those two side by side and
nothing else (``ModelConfig.kv_cache_parts``). Queries come through a ``q_lora_rank`` bottleneck
(or straight from the hidden state). ``kv_b_proj`` [R, N, Dn + Dv] turns a latent into every head's
non-rotary key (its first Dn columns, W_uk) and value (the rest, W_uv).

The layer attends in one of two forms (``form``): ``absorbed``, the query taken into the latent
space and the cache read as it lies by the paged-attention kernel, or ``decompressed``, the keys
and values expanded page by page (``kernels.paged_attention.latent``). Both compute the same.

Under tensor parallelism the heads split (q_b_proj / q_proj, kv_b_proj and o_proj by heads); the
down projections, their norms and the cache are replicated: every device reads every token's
latent and attends for its own heads.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.matmul.cpu_matmul import PanelWeight
from jaxengine.kernels.matmul.quantized import QuantizedWeight, TiledWeight
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.kernels.paged_attention.backend import where_served
from jaxengine.kernels.paged_attention.latent import FORMS, absorbed_attention, decompressed_attention
from jaxengine.kernels.paged_attention.layout import is_fp8
from jaxengine.kernels.paged_attention.reference import write_rows
from jaxengine.models.config import ModelConfig, YarnScaling
from jaxengine.models.layers import (M, RMSNorm, _param, apply_rope, rope_attention_factor, to_fp8, weight,
                                    yarn_mscale)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(query head size), times YaRN's mscale(factor, mscale_all_dim) squared where set."""
    scale = cfg.qk_head_dim ** -0.5
    sc = cfg.rope_scaling
    if isinstance(sc, YarnScaling) and cfg.mscale_all_dim:
        scale *= yarn_mscale(sc.factor, cfg.mscale_all_dim) ** 2
    return scale


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, attention_fn: Callable, *, form: str = "absorbed",
                 rngs: nnx.Rngs) -> None:
        """``form``: how it attends (``FORMS``)."""
        if form not in FORMS:
            raise ValueError(f"latent_attention_form: {form!r} is not one of {FORMS}")
        d, n, r, hr = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = weight(cfg, "q_proj", rngs, (d, n, cfg.qk_head_dim), dtype, (None, M, None))
        else:
            self.q_a_proj = _param(rngs, (d, cfg.q_lora_rank), dtype, (None, None))
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = _param(rngs, (cfg.q_lora_rank, n, cfg.qk_head_dim), dtype, (None, M, None))
        self.kv_a_proj = _param(rngs, (d, r + hr), dtype, (None, None))
        self.kv_a_norm = RMSNorm(r, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = _param(rngs, (r, n, cfg.qk_nope_head_dim + cfg.v_head_dim), dtype, (None, M, None))
        self.o_proj = weight(cfg, "o_proj", rngs, (n, cfg.v_head_dim, d), dtype, (M, None, None))
        self.cfg = cfg
        self.form = form
        self.attention_fn = where_served(attention_fn)     # (the Pallas kernels take no head of R + Hr)
        self.dense_fn = dense

    def __call__(self, x: jax.Array, cache: tuple[jax.Array], md: AttentionMetadata, inv_freq: np.ndarray,
                 layer: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array]]:
        """x [T, D], the cache (one array, [P, S, R + Hr]) -> ([T, D], the cache)."""
        cfg = self.cfg
        dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q = self.dense_fn(x, self.q_proj[...], layer)
        else:
            q = self.dense_fn(self.q_a_norm(self.dense_fn(x, self.q_a_proj[...], layer)), self.q_b_proj[...], layer)
        kv = self.dense_fn(x, self.kv_a_proj[...], layer)                       # [T, R + Hr]
        latent, k_rope = self.kv_a_norm(kv[:, :r]), kv[:, None, r:]
        scale = rope_attention_factor(cfg)
        q_nope, q_rope = q[..., :dn], apply_rope(q[..., dn:], md.positions, inv_freq, scale)
        k_rope = apply_rope(k_rope, md.positions, inv_freq, scale)
        rows = jnp.concatenate([latent[:, None, :], k_rope.astype(latent.dtype)], axis=-1)
        (pages,) = cache
        if is_fp8(pages.dtype):                # an FP8 cache: unscaled, as a KV cache without scales
            rows = to_fp8(rows, jnp.float32(1.0))
        pages = write_rows(pages, rows, md.slot_mapping)                      # before this step's reads
        kv_b = self.kv_b_proj[...]
        kv_b = kv_b if layer is None else kv_b[layer]
        w_uk, w_uv = kv_b[..., :dn], kv_b[..., dn:]
        if self.form == "absorbed":
            o = absorbed_attention(q_nope, q_rope, pages, md, w_uk, w_uv, scale=softmax_scale(cfg),
                                   attention_fn=self.attention_fn)
        else:
            o = decompressed_attention(q_nope, q_rope, pages, md, w_uk, w_uv, scale=softmax_scale(cfg))
        o_proj = self.o_proj[...]                                    # [(L,) N, Dv, D] -> [(L,) N*Dv, D]
        if not isinstance(o_proj, (QuantizedWeight, TiledWeight, PanelWeight)):   # (a quantized one contracts N, Dv itself)
            o_proj = o_proj.reshape(*o_proj.shape[:-3], -1, o_proj.shape[-1])
        return self.dense_fn(o.reshape(o.shape[0], -1), o_proj, layer), (pages,)

