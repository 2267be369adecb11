"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache that holds, per token, one
compressed latent c [R] and one rotary key k_r [Hr] shared by every head, side by side: pages
[P, S, R + Hr].

Every head's key is (c W_uk[n], k_r) and its value c W_uv[n], so attention can run two ways:

- absorbed: the query's non-rotary part goes into the latent space (q_n W_uk[n]^T), and
  attention runs over the cache as it lies, as multi-query attention with one key head of size
  R + Hr whose value is the key itself; the output's latent part comes back through W_uv. Any
  paged-attention kernel serves (``absorbed_attention``), and no key is ever decompressed: the
  decode form, reading R + Hr numbers per cached token however many heads there are.
- decompressed: each page's latents are expanded into per-head keys and values as they are read
  (``decompressed_attention``, plain jnp, the page loop of ``reference.paged_attention``): the
  form written as the model defines it, the reference the absorbed one is checked against.

Shapes: T tokens, N heads, Dn / Dv a head's non-rotary key / value size, R the latent, Hr the
rotary key, S the page size.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxengine.kernels.paged_attention import online_softmax
from jaxengine.kernels.paged_attention.layout import heads_together, values
from jaxengine.kernels.paged_attention.metadata import AttentionMetadata

FORMS = ("absorbed", "decompressed")


def absorbed_attention(q_nope: jax.Array, q_rope: jax.Array, cache: jax.Array, md: AttentionMetadata,
                       w_uk: jax.Array, w_uv: jax.Array, *, scale: float, attention_fn: Callable) -> jax.Array:
    """q_nope [T, N, Dn], q_rope [T, N, Hr], w_uk [R, N, Dn], w_uv [R, N, Dv] -> [T, N, Dv].
    ``attention_fn``: a paged-attention kernel (q [T, N, H], k and v caches [P, S, K*H]: here K = 1)."""
    rank = w_uk.shape[0]
    q_latent = jnp.einsum("tnd,rnd->tnr", q_nope, w_uk)                 # the query in the latent space
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    out = attention_fn(q, cache, cache, md, scale=scale)                 # [T, N, R + Hr]: values = keys
    return jnp.einsum("tnr,rne->tne", out[..., :rank], w_uv.astype(out.dtype))


def decompressed_attention(q_nope: jax.Array, q_rope: jax.Array, cache: jax.Array, md: AttentionMetadata,
                           w_uk: jax.Array, w_uv: jax.Array, *, scale: float) -> jax.Array:
    """As ``absorbed_attention``, each page's latents expanded into every head's keys and values
    as they are read: per query token and page, [S, N, Dn] keys and [S, N, Dv] values."""
    num_tokens, num_heads, _ = q_nope.shape
    cache = heads_together(cache)
    rank, page_size = w_uk.shape[0], cache.shape[1]
    rows = jnp.minimum(md.token_rows, md.block_tables.shape[0] - 1)
    valid = md.token_rows < md.block_tables.shape[0]
    tables = md.block_tables[rows]                                       # [T, M]
    pos = md.positions
    qn, qr = q_nope.astype(jnp.float32) * scale, q_rope.astype(jnp.float32) * scale
    w_uk, w_uv = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)

    def page_step(page, carry):
        pages = values(cache[tables[:, page]]).astype(jnp.float32)     # [T, S, R + Hr]
        latent, k_rope = pages[..., :rank], pages[..., rank:]
        k_nope = jnp.einsum("tsr,rnd->tnsd", latent, w_uk)
        v = jnp.einsum("tsr,rne->tnse", latent, w_uv)
        s = jnp.einsum("tnd,tnsd->tns", qn, k_nope) + jnp.einsum("tnh,tsh->tns", qr, k_rope)
        key_pos = page * page_size + jnp.arange(page_size)
        mask = (key_pos[None, :] <= pos[:, None]) & valid[:, None]
        return online_softmax.update(carry, s, mask[:, None, :], lambda p: jnp.einsum("tns,tnse->tne", p, v))

    init = online_softmax.init((num_tokens, num_heads), w_uv.shape[-1])
    num_pages = jnp.minimum((jnp.max(md.seq_lens) + page_size - 1) // page_size, tables.shape[1])
    _, l, acc = jax.lax.fori_loop(0, num_pages, page_step, init)
    return online_softmax.finish(l, acc).astype(q_nope.dtype)
