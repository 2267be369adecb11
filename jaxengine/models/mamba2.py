"""Mamba-2: the state-space layers of Nemotron-H, whose memory is a fixed-size recurrent state per
sequence instead of a KV cache.

Per sequence a layer keeps a convolution window (the last ``kernel - 1`` inputs of its causal
depthwise convolution, [K-1, C]) and a state per head ([H, P, N]: head size by state size). One
projection gives each token a gate z, the convolution's input (x, B and C side by side) and a time
step per head. After the convolution (SiLU), with ``dt = softplus(dt + dt_bias)`` clamped to the
layer's limits, each head's state decays by ``exp(-exp(A_log) * dt)`` and adds ``dt * x B^T``
(B shared by the heads of its group); the token reads ``S C`` plus ``D * x``. The output times
SiLU(z) is RMS-normalised per group of heads and projected back.

A step's flat ragged batch runs in segments of one row's tokens (the chunked "SSD" form within a
segment), or, in a decode step, every row's one token at once (``models.recurrent.scan_rows``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.models.config import Mamba2Shape
from jaxengine.models.layers import _param
from jaxengine.models.recurrent import CHUNK_SIZE, chunked, decays as _decays, scan_rows

__all__ = ["Mamba2", "Mamba2Shape"]


class Mamba2(nnx.Module):
    """Weights as transformers' ``NemotronHMamba2Mixer`` holds them, projections kept [in, out]
    (read through ``dense_fn``: in a layer scan they stay stacked, [L, in, out], and the call names
    its layer)."""

    def __init__(self, shape: Mamba2Shape, dtype, *, rngs: nnx.Rngs) -> None:
        s, d = shape, shape.hidden_size
        self.shape = shape
        self.in_proj = _param(rngs, (d, s.projection_dim), dtype, (None, None))
        self.conv_weight = _param(rngs, (s.conv_kernel, s.conv_dim), dtype, (None, None))   # [K, C], tap 0 oldest
        if s.conv_bias:
            self.conv_bias = nnx.Param(jnp.zeros((s.conv_dim,), dtype))
        self.dt_bias = nnx.Param(jnp.ones((s.num_heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((s.num_heads,), dtype))
        self.D = nnx.Param(jnp.ones((s.num_heads,), dtype))
        self.norm_weight = nnx.Param(jnp.ones((s.inner_dim,), dtype))
        self.out_proj = _param(rngs, (s.inner_dim, d), dtype, (None, None))
        if s.proj_bias:
            self.in_bias = nnx.Param(jnp.zeros((s.projection_dim,), dtype))
            self.out_bias = nnx.Param(jnp.zeros((d,), dtype))
        self.dense_fn = dense
        self.chunk_size = CHUNK_SIZE      # tokens of a segment in the chunked form, at most
        self.recurrent_form = "auto"      # models.recurrent.FORMS (models.recurrent.set_form)

    def __call__(self, x: jax.Array, token_rows: jax.Array, conv_state: jax.Array, state: jax.Array,
                 layer: jax.Array | None = None, captures: jax.Array | None = None,
                 num_captures: int = 0, one_token_rows: jax.Array | None = None,
                 num_valid: jax.Array | int | None = None) -> tuple[jax.Array, ...]:
        """As ``GatedDeltaNet.__call__``: x [T, D], each token's row, the rows' states ([B, K-1, C],
        [B, H, P, N]) -> (the output [T, D], the states after the step, the snapshots' states)."""
        s = self.shape
        f32 = jnp.float32
        h, p, n, g = s.num_heads, s.head_dim, s.state_size, s.num_groups
        projected = self.dense_fn(x, self.in_proj[...], layer)
        if s.proj_bias:
            projected = projected + self.in_bias[...]
        z, mixed, dt = jnp.split(projected, [s.inner_dim, s.inner_dim + s.conv_dim], axis=-1)
        dt = jnp.clip(jax.nn.softplus(dt.astype(f32) + self.dt_bias[...].astype(f32)), s.dt_min, s.dt_max)  # [T, H]
        A = -jnp.exp(self.A_log[...].astype(f32))
        D = self.D[...].astype(f32)

        def step(xbc, S, dt_t):
            xs = xbc[:s.inner_dim].reshape(h, p)
            B, C = (jnp.repeat(m.reshape(g, n), h // g, axis=0) for m in jnp.split(xbc[s.inner_dim:], 2))  # [H, N]
            S = S * jnp.exp(dt_t * A)[:, None, None] + (dt_t[:, None] * xs)[:, :, None] * B[:, None, :]
            return S, jnp.einsum("hpn,hn->hp", S, C) + D[:, None] * xs

        def segment(xbc, S, dt_s, valid):
            """The SSD form over a segment of one row's tokens: their mixing within it ("attention"
            of C against B under the decays between them), and what they read of and add to S."""
            xs = xbc[:, :s.inner_dim].reshape(-1, h, p)                                  # [S, H, P]
            B, C = (jnp.repeat(m.reshape(-1, g, n), h // g, axis=1) for m in jnp.split(xbc[:, s.inner_dim:], 2, axis=1))
            dt_s = jnp.where(valid[:, None], dt_s, 0)                                    # padding: no step
            cum = jnp.cumsum(dt_s * A, axis=0)                                           # [S, H]
            decay = _decays(cum.T)                                                       # [H, S, S]
            scores = jnp.einsum("ihn,jhn->hij", C, B) * decay
            y = jnp.einsum("hij,jh,jhp->ihp", scores, dt_s, xs)
            y = y + jnp.einsum("hpn,ihn->ihp", S, C) * jnp.exp(cum)[:, :, None] + D[:, None] * xs
            to_end = jnp.exp(cum[-1] - cum) * dt_s                                       # [S, H]
            S = S * jnp.exp(cum[-1])[:, None, None] + jnp.einsum("jh,jhp,jhn->hpn", to_end, xs, B)
            return S, y

        in_segments = chunked(self.recurrent_form)
        out, *states = scan_rows(step, mixed, dt, token_rows, conv_state, state, self.conv_weight[...],
                                 self.conv_bias[...] if s.conv_bias else None, captures, num_captures,
                                 one_token_rows if in_segments else None, segment if in_segments else None,
                                 self.chunk_size, num_valid)
        out = _gated_group_norm(out.reshape(out.shape[0], -1), z.astype(f32), self.norm_weight[...], g,
                                s.rms_norm_eps).astype(x.dtype)
        out = self.dense_fn(out, self.out_proj[...], layer)
        return (out + self.out_bias[...] if s.proj_bias else out, *states)


def _gated_group_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, groups: int, eps: float) -> jax.Array:
    """x times SiLU(gate), then RMS-normalised per group of its channels (transformers'
    ``NemotronHRMSNormGated``, the gate before the norm)."""
    x = x * jax.nn.silu(gate)
    grouped = x.reshape(x.shape[0], groups, -1)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * grouped.reshape(x.shape)
