"""Gated DeltaNet: the linear-attention layers of Qwen3.5 (three in four of its layers), whose memory
is a fixed-size recurrent state per sequence instead of a KV cache.

Per sequence a layer keeps a convolution window (the last ``kernel - 1`` inputs of its causal
depthwise convolution, [K-1, C]) and a matrix state per value head ([Hv, dk, dv]). Each token's
projected q, k, v pass the convolution (SiLU), q and k are L2-normalised (q also scaled by
``dk ** -0.5``), and the state decays by ``exp(g)`` (``g = -exp(A_log) * softplus(a + dt_bias)``)
before the delta rule writes ``beta * (v - S^T k)`` along k; the token reads ``S^T q``. The
output is RMS-normalised per head, gated by ``SiLU(z)`` and projected back.

A step's flat ragged batch runs in segments of one row's tokens (the chunked form within a
segment), or, in a decode step, every row's one token at once (``models.recurrent.scan_rows``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.models.config import GatedDeltaNetShape
from jaxengine.models.layers import _param
from jaxengine.models.recurrent import CHUNK_SIZE, chunked, decays as _decays, scan_rows, unit_lower_inverse

__all__ = ["GatedDeltaNet", "GatedDeltaNetShape"]


class GatedDeltaNet(nnx.Module):
    """Weights as transformers' ``Qwen3_5GatedDeltaNet`` holds them, projections kept [in, out]
    (read through ``dense_fn``: in a layer scan they stay stacked, [L, in, out], and the call
    names its layer)."""

    def __init__(self, shape: GatedDeltaNetShape, dtype, *, rngs: nnx.Rngs) -> None:
        s, d = shape, shape.hidden_size
        self.shape = shape
        self.in_proj_qkv = _param(rngs, (d, s.conv_dim), dtype, (None, None))
        self.in_proj_z = _param(rngs, (d, s.value_dim), dtype, (None, None))
        self.in_proj_b = _param(rngs, (d, s.num_value_heads), dtype, (None, None))
        self.in_proj_a = _param(rngs, (d, s.num_value_heads), dtype, (None, None))
        self.conv_weight = _param(rngs, (s.conv_kernel, s.conv_dim), dtype, (None, None))   # [K, C], tap 0 oldest
        self.dt_bias = nnx.Param(jnp.ones((s.num_value_heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((s.num_value_heads,), dtype))
        self.norm_weight = nnx.Param(jnp.ones((s.value_head_dim,), dtype))
        self.out_proj = _param(rngs, (s.value_dim, d), dtype, (None, None))
        self.dense_fn = dense
        self.chunk_size = CHUNK_SIZE      # tokens of a segment in the chunked form, at most
        self.recurrent_form = "auto"      # models.recurrent.FORMS (models.recurrent.set_form)

    def __call__(self, x: jax.Array, token_rows: jax.Array, conv_state: jax.Array, state: jax.Array,
                 layer: jax.Array | None = None, captures: jax.Array | None = None,
                 num_captures: int = 0, one_token_rows: jax.Array | None = None,
                 num_valid: jax.Array | int | None = None) -> tuple[jax.Array, ...]:
        """x [T, D]; ``token_rows`` [T]: each token's row (B or more for padding, which changes no
        row); ``conv_state`` [B, K-1, C] and ``state`` [B, Hv, dk, dv], the rows' states before the
        step -> (the layer's output [T, D], the states after it). ``layer``: the projections are
        stacked and this is layer ``layer`` of them. ``captures`` [T]: where each token's row's
        states after it go among ``num_captures`` snapshots (``num_captures``: none), which come
        after the states ([N, K-1, C] and [N, Hv, dk, dv]). ``one_token_rows``: a traced bool, no
        row has more than one token (``models.recurrent.scan_rows``)."""
        s = self.shape
        f32 = jnp.float32

        def project(w, x=x):
            return self.dense_fn(x, w[...], layer)

        mixed = project(self.in_proj_qkv)                                         # [T, C]
        z = project(self.in_proj_z).reshape(-1, s.num_value_heads, s.value_head_dim)
        beta = jax.nn.sigmoid(project(self.in_proj_b).astype(f32))                # [T, Hv]
        a = project(self.in_proj_a).astype(f32)
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a + self.dt_bias[...].astype(f32))
        repeat = s.num_value_heads // s.num_key_heads

        def step(qkv, S, per_token):
            g_t, beta_t = per_token
            q, k, v = jnp.split(qkv, [s.key_dim, 2 * s.key_dim])
            q = _l2norm(q.reshape(s.num_key_heads, s.key_head_dim)) * s.key_head_dim ** -0.5
            k = _l2norm(k.reshape(s.num_key_heads, s.key_head_dim))
            q, k = jnp.repeat(q, repeat, axis=0), jnp.repeat(k, repeat, axis=0)     # [Hv, dk]
            v = v.reshape(s.num_value_heads, s.value_head_dim)
            S = S * jnp.exp(g_t)[:, None, None]                                      # [Hv, dk, dv]
            delta = (v - jnp.einsum("hkv,hk->hv", S, k)) * beta_t[:, None]
            S = S + k[:, :, None] * delta[:, None, :]
            return S, jnp.einsum("hkv,hk->hv", S, q)

        def segment(qkv, S, per_token, valid):
            """The chunked form over a segment of one row's tokens: the delta rule's updates within
            it folded into one triangular solve (the "UT transform"), what they read of the state
            before it and within it, and the state after it."""
            g_s, beta_s = (jnp.where(valid[:, None], a, 0) for a in per_token)       # padding: no step
            q, k, v = jnp.split(qkv, [s.key_dim, 2 * s.key_dim], axis=1)
            q = _l2norm(q.reshape(-1, s.num_key_heads, s.key_head_dim)) * s.key_head_dim ** -0.5
            k = jnp.where(valid[:, None, None], _l2norm(k.reshape(-1, s.num_key_heads, s.key_head_dim)), 0)
            q, k = (jnp.repeat(a, repeat, axis=1).transpose(1, 0, 2) for a in (q, k))     # [Hv, S, dk]
            v = v.reshape(-1, s.num_value_heads, s.value_head_dim).transpose(1, 0, 2)      # [Hv, S, dv]
            cum = jnp.cumsum(g_s, axis=0).T                                                # [Hv, S]
            decay = _decays(cum)                                                           # [Hv, S, S]
            k_beta = k * beta_s.T[:, :, None]
            inverse = unit_lower_inverse(jnp.tril(jnp.einsum("hid,hjd->hij", k_beta, k) * decay, -1))
            new_values = inverse @ (v * beta_s.T[:, :, None])
            k_decayed = inverse @ (k_beta * jnp.exp(cum)[:, :, None])
            v_new = new_values - jnp.einsum("hik,hkv->hiv", k_decayed, S)
            out = jnp.einsum("hik,hkv->hiv", q * jnp.exp(cum)[:, :, None], S) + \
                jnp.einsum("hij,hjv->hiv", jnp.einsum("hid,hjd->hij", q, k) * decay, v_new)
            to_end = jnp.exp(cum[:, -1:] - cum)[:, :, None]
            S = S * jnp.exp(cum[:, -1])[:, None, None] + jnp.einsum("hjk,hjv->hkv", k * to_end, v_new)
            return S, out.transpose(1, 0, 2)

        in_segments = chunked(self.recurrent_form)
        out, *states = scan_rows(step, mixed, (g, beta), token_rows, conv_state, state, self.conv_weight[...],
                                 captures=captures, num_captures=num_captures,
                                 one_token_rows=one_token_rows if in_segments else None,
                                 segment=segment if in_segments else None, chunk_size=self.chunk_size,
                                 num_valid=num_valid)
        out = _gated_rms_norm(out, z.astype(f32), self.norm_weight[...], s.rms_norm_eps).astype(x.dtype)
        out = project(self.out_proj, out.reshape(out.shape[0], -1))
        return (out, *states)


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMS norm per head, then times SiLU(gate) (transformers' ``Qwen3_5RMSNormGated``)."""
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * x * jax.nn.silu(gate)
