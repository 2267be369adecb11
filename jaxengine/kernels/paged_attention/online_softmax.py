"""The online-softmax step shared by the paged-attention variants: fold one block of scores into
running (max, normaliser, accumulator), in f32; rows with nothing to attend to end as zeros.

An attention sink (gpt-oss: one learned logit per query head) is a key of that score whose
value is zero: it only enlarges the normaliser. Starting the running state at (sink, 1, 0)
instead of (-inf, 0, 0) is exactly that, at no cost per key."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def update(carry: tuple, s: jax.Array, mask: jax.Array, weigh_values: Callable[[jax.Array], jax.Array]) -> tuple:
    """carry = (m, l, acc); s: scores [..., keys]; mask broadcastable to s; weigh_values(p) -> p @ V."""
    m, l, acc = carry
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)         # no key yet: keep exp() finite
    p = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    return m_new, l * correction + p.sum(-1), acc * correction[..., None] + weigh_values(p)


def init(shape: tuple[int, ...], head_size: int, sinks: jax.Array | None = None) -> tuple:
    """The empty running state; ``sinks`` (broadcastable to ``shape``): each row's sink logit."""
    acc = jnp.zeros((*shape, head_size), jnp.float32)
    if sinks is None:
        return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), acc
    return jnp.broadcast_to(sinks.astype(jnp.float32), shape), jnp.ones(shape, jnp.float32), acc


def finish(l: jax.Array, acc: jax.Array) -> jax.Array:
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
