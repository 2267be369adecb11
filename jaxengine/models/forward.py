"""The model split once into (graphdef, state) and one pure jitted step with the KV cache donated."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.mesh import cache_shardings, replicated


def _logits(model, hidden: jax.Array, logits_indices: jax.Array) -> jax.Array:
    return model.compute_logits(hidden[logits_indices])


def feed_previous_tokens(input_ids: jax.Array, previous: jax.Array, index: jax.Array) -> jax.Array:
    """Async scheduling: a token the host does not know yet (index >= 0) is taken from the
    previous step's sampled tokens, still on the device."""
    return jnp.where(index >= 0, previous[jnp.maximum(index, 0)], input_ids)


def make_forward(model: nnx.Module, head: Callable = _logits, mesh=None, expert_counts: bool = False,
                 aux_layers: tuple[int, ...] = ()) -> tuple[nnx.State, Callable]:
    """Returns (state, forward); ``forward(state, kv_caches, input_ids, md, logits_indices, *extra)``
    (``input_ids`` may be ``(ids, previous step's tokens, index into them or -1)``)
    -> (kv_caches, head(model, hidden [T, D], logits_indices, *extra)); the default head returns the
    logits [R, V] (f32) of the rows asked for; a sampler plugs in here. The caches passed in are
    donated: use the returned ones. With a ``mesh`` the caches keep their KV-head sharding and
    what the head returns is replicated (host inputs are replicated too). With ``expert_counts``
    the head must return a tuple, and the step's tokens routed to each expert [E] (E = 0 for a
    dense model) come after its items, and with ``aux_layers`` the hidden states entering those
    layers after them ([T, len(aux_layers) * D], what an EAGLE-3 head reads)."""
    graphdef, state = nnx.split(model)

    def forward(state, kv_caches, input_ids, md: AttentionMetadata, logits_indices: jax.Array, *extra):
        if isinstance(input_ids, tuple):
            input_ids = feed_previous_tokens(*input_ids)
        m = nnx.merge(graphdef, state)
        if aux_layers:
            hidden, kv_caches, counts, aux = m.forward_with_aux_hidden(input_ids, kv_caches, md, aux_layers)
            return kv_caches, (*head(m, hidden, logits_indices, *extra), counts, aux)
        hidden, kv_caches, counts = m.forward_with_expert_counts(input_ids, kv_caches, md)
        out = head(m, hidden, logits_indices, *extra)
        return kv_caches, (*out, counts) if expert_counts else out

    if mesh is None:
        return state, jax.jit(forward, donate_argnums=(1,))
    kv_sharding = cache_shardings(mesh, getattr(model, "config", None))
    return state, jax.jit(forward, donate_argnums=(1,), out_shardings=(kv_sharding, replicated(mesh)))
