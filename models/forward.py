"""The model split once into (graphdef, state) and one pure jitted step with the KV cache donated."""
from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata


def _logits(model, hidden: jax.Array, logits_indices: jax.Array) -> jax.Array:
    return model.compute_logits(hidden[logits_indices])


def make_forward(model: nnx.Module, head: Callable = _logits) -> tuple[nnx.State, Callable]:
    """Returns (state, forward); ``forward(state, kv_caches, input_ids, md, logits_indices, *extra)``
    -> (kv_caches, head(model, hidden [T, D], logits_indices, *extra)); the default head returns the
    logits [R, V] (f32) of the rows asked for; a sampler plugs in here. The caches passed in are
    donated: use the returned ones."""
    graphdef, state = nnx.split(model)

    def forward(state, kv_caches, input_ids: jax.Array, md: AttentionMetadata, logits_indices: jax.Array, *extra):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(input_ids, kv_caches, md)
        return kv_caches, head(m, hidden, logits_indices, *extra)

    return state, jax.jit(forward, donate_argnums=(1,))
