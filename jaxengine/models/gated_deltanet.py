"""Gated DeltaNet: the linear-attention layers of Qwen3.5 (three in four of its layers), whose memory
is a fixed-size recurrent state per sequence instead of a KV cache.

Per sequence a layer keeps a convolution window (the last ``kernel - 1`` inputs of its causal
depthwise convolution, [K-1, C]) and a matrix state per value head ([Hv, dk, dv]). Each token's
projected q, k, v pass the convolution (SiLU), q and k are L2-normalised (q also scaled by
``dk ** -0.5``), and the state decays by ``exp(g)`` (``g = -exp(A_log) * softplus(a + dt_bias)``)
before the delta rule writes ``beta * (v - S^T k)`` along k; the token reads ``S^T q``. The
output is RMS-normalised per head, gated by ``SiLU(z)`` and projected back.

This is the plain form for a step's flat ragged batch: one pass over the step's tokens in order,
each updating its own row's state (``token_rows``), so a row's tokens may be a prompt's chunk or
one decode token alike. A row starting a sequence starts from zero states (the caller gathers
them so); the states after the step are returned for the caller to keep.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.models.config import GatedDeltaNetShape
from jaxengine.models.layers import _param

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

    def __call__(self, x: jax.Array, token_rows: jax.Array, conv_state: jax.Array, state: jax.Array,
                 layer: jax.Array | None = None, captures: jax.Array | None = None,
                 num_captures: int = 0) -> tuple[jax.Array, ...]:
        """x [T, D]; ``token_rows`` [T]: each token's row (B or more for padding, which changes no
        row); ``conv_state`` [B, K-1, C] and ``state`` [B, Hv, dk, dv], the rows' states before the
        step -> (the layer's output [T, D], the states after it). ``layer``: the projections are
        stacked and this is layer ``layer`` of them. ``captures`` [T]: where each token's row's
        states after it go among ``num_captures`` snapshots (``num_captures``: none), which come
        after the states ([N, K-1, C] and [N, Hv, dk, dv])."""
        s = self.shape
        f32 = jnp.float32

        def project(w, x=x):
            return self.dense_fn(x, w[...], layer)

        mixed = project(self.in_proj_qkv)                                         # [T, C]
        z = project(self.in_proj_z).reshape(-1, s.num_value_heads, s.value_head_dim)
        beta = jax.nn.sigmoid(project(self.in_proj_b).astype(f32))                # [T, Hv]
        a = project(self.in_proj_a).astype(f32)
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a + self.dt_bias[...].astype(f32))
        weight = self.conv_weight[...].astype(f32)
        repeat = s.num_value_heads // s.num_key_heads
        num_rows = state.shape[0]
        # A padding row past the real ones takes the padding tokens' updates.
        conv_state = jnp.concatenate([conv_state.astype(f32), jnp.zeros((1, *conv_state.shape[1:]), f32)])
        state = jnp.concatenate([state.astype(f32), jnp.zeros((1, *state.shape[1:]), f32)])
        rows = jnp.minimum(token_rows, num_rows)
        # Snapshots: a buffer row per snapshot, and one past them that the other tokens write.
        captured = (jnp.zeros((num_captures + 1, *conv_state.shape[1:]), f32),
                    jnp.zeros((num_captures + 1, *state.shape[1:]), f32))
        capture_of = jnp.full(rows.shape, num_captures, jnp.int32) if captures is None else captures

        def token(carry, per_token):
            conv_state, state, (captured_conv, captured_state) = carry
            mixed_t, g_t, beta_t, r, c = per_token
            window = jnp.concatenate([conv_state[r], mixed_t.astype(f32)[None]])     # [K, C]
            conv_state = conv_state.at[r].set(window[1:])
            qkv = jax.nn.silu(jnp.sum(window * weight, axis=0))
            q, k, v = jnp.split(qkv, [s.key_dim, 2 * s.key_dim])
            q = _l2norm(q.reshape(s.num_key_heads, s.key_head_dim)) * s.key_head_dim ** -0.5
            k = _l2norm(k.reshape(s.num_key_heads, s.key_head_dim))
            q, k = jnp.repeat(q, repeat, axis=0), jnp.repeat(k, repeat, axis=0)     # [Hv, dk]
            v = v.reshape(s.num_value_heads, s.value_head_dim)
            S = state[r] * jnp.exp(g_t)[:, None, None]                               # [Hv, dk, dv]
            delta = (v - jnp.einsum("hkv,hk->hv", S, k)) * beta_t[:, None]
            S = S + k[:, :, None] * delta[:, None, :]
            state = state.at[r].set(S)
            if num_captures:
                captured_conv, captured_state = captured_conv.at[c].set(window[1:]), captured_state.at[c].set(S)
            return (conv_state, state, (captured_conv, captured_state)), jnp.einsum("hkv,hk->hv", S, q)

        (conv_state, state, captured), out = jax.lax.scan(token, (conv_state, state, captured),
                                                          (mixed, g, beta, rows, capture_of))
        out = _gated_rms_norm(out, z.astype(f32), self.norm_weight[...], s.rms_norm_eps).astype(x.dtype)
        out = project(self.out_proj, out.reshape(out.shape[0], -1))
        if num_captures:
            return out, conv_state[:num_rows], state[:num_rows], captured[0][:-1], captured[1][:-1]
        return out, conv_state[:num_rows], state[:num_rows]


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMS norm per head, then times SiLU(gate) (transformers' ``Qwen3_5RMSNormGated``)."""
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * x * jax.nn.silu(gate)
