"""The naive JAX baseline: greedy decoding in static batches with a dense KV cache, on the engine's
own Flax weights, without paging or continuous batching.

Each batch is left-padded to its longest prompt and decodes for its longest output: one jitted
function per batch shape runs the prefill of the whole padded batch, then a ``fori_loop`` of
decode steps, each appending one column to a dense [layers, batch, columns, KV heads, head size]
cache and attending over every column (masked to the row's own tokens). Norms, MLP and logits
are the model's own modules; only attention and its cache are written here with jax.numpy.
Prompt widths and output counts are rounded up to multiples of ``ROUND`` so that few shapes
compile; the extra tokens are computed and dropped, as a static batch's shorter rows are. Every
shape compiles before the timed run (its compile time is reported apart, as the engine's is).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxengine.bench.datasets import BenchRequest
from jaxengine.models.layers import apply_rope, rope_attention_factor, rope_inv_freq
from jaxengine.models.panels import plain

ROUND = 32
MASKED = -1e30      # finite: a padding query row, which sees no key, then stays finite


def run_naive(model, requests: list[BenchRequest], batch_size: int, progress: bool = True) -> tuple[dict, list]:
    """Time the requests through the naive loop; returns (figures, generated token ids per request)."""
    check_serves(model.config)
    graphdef, state = nnx.split(model)
    step = jax.jit(functools.partial(_generate, graphdef), static_argnames="num_new")
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    start = time.perf_counter()
    compiled = {shape: _compile(step, state, *shape) for shape in sorted({_shape(b) for b in batches})}
    compile_s = time.perf_counter() - start
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for batch in tqdm(batches, desc="naive baseline", unit="batch", disable=not progress):
        ids, pad = _left_padded(batch, _shape(batch)[1])
        out = np.asarray(compiled[_shape(batch)](state, ids, pad))
        tokens += [row[:r.output_len].tolist() for row, r in zip(out, batch)]
    seconds = time.perf_counter() - start
    return {"elapsed_s": seconds, "compile_s": compile_s, "batch_size": batch_size,
            "num_shapes": len(compiled)}, tokens


def check_serves(cfg) -> None:
    """ValueError naming ``--baseline naive`` for a model its dense Llama loop does not compute."""
    unsupported = [name for name, present in (
        ("a mixture of experts", cfg.is_moe), ("attention sinks", cfg.attention_sinks),
        ("sliding and full layers mixed", cfg.mixes_windows), ("an o_proj bias", cfg.output_bias),
        ("weights kept quantized (run it with --quantization none)", bool(cfg.quantization))) if present]
    if unsupported:
        raise ValueError(f"--baseline naive: the plain JAX loop runs dense Llama-family models; "
                         f"{cfg.architecture} has {', '.join(unsupported)} (use --baseline hf or vllm)")


def _shape(batch: list[BenchRequest]) -> tuple[int, int, int]:
    """(rows, padded prompt width, decode steps) of a batch."""
    width = max(len(r.prompt_token_ids) for r in batch)
    steps = max(r.output_len for r in batch)
    return len(batch), -(-width // ROUND) * ROUND, -(-steps // ROUND) * ROUND


def _compile(step, state, rows: int, width: int, num_new: int):
    spec = (jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32))
    return step.lower(state, *spec, num_new=num_new).compile()


def _left_padded(batch: list[BenchRequest], width: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(batch), width), np.int32)
    pad = np.array([width - len(r.prompt_token_ids) for r in batch], np.int32)
    for row, (r, p) in enumerate(zip(batch, pad)):
        ids[row, p:] = r.prompt_token_ids
    return ids, pad


def _generate(graphdef, state, ids: jax.Array, pad: jax.Array, num_new: int) -> jax.Array:
    """Greedy tokens [B, num_new] after the left-padded prompts ``ids`` [B, W] (``pad`` [B] columns)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    rows, width = ids.shape
    shape = (cfg.num_layers, rows, width + num_new, cfg.num_kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape, plain(model.embed_tokens).dtype),) * 2
    logits, cache = _forward(model, ids, pad, cache, 0)
    tokens = jnp.zeros((rows, num_new), jnp.int32).at[:, 0].set(jnp.argmax(logits, axis=-1))

    def decode(i, carry):
        tokens, cache = carry
        last = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
        logits, cache = _forward(model, last, pad, cache, width + i - 1)
        return tokens.at[:, i].set(jnp.argmax(logits, axis=-1)), cache

    tokens, _ = jax.lax.fori_loop(1, num_new, decode, (tokens, cache))
    return tokens


def _forward(model, ids: jax.Array, pad: jax.Array, cache, start) -> tuple:
    """Tokens ``ids`` [B, T] at cache columns start..start+T -> the last token's logits [B, V]."""
    inv_freq = rope_inv_freq(model.config)
    columns = start + jnp.arange(ids.shape[1])
    positions = jnp.maximum(columns[None, :] - pad[:, None], 0)        # [B, T]; padding tokens at 0
    mask = _mask(columns, pad, cache[0].shape[2], model.config.sliding_window)
    x = jnp.take(plain(model.embed_tokens), ids, axis=0)
    graphdef, stacked = nnx.split(model.layers)

    def layer_step(x, per_layer):
        state, k_cache, v_cache = per_layer
        layer = nnx.merge(graphdef, state)
        attn, k_cache, v_cache = _attention(layer.self_attn, layer.input_layernorm(x), positions, mask,
                                            k_cache, v_cache, start, inv_freq)
        x = x + attn
        b, t, d = x.shape
        x = x + layer.mlp(layer.post_attention_layernorm(x).reshape(b * t, d)).reshape(b, t, d)
        return x, (k_cache, v_cache)

    x, cache = jax.lax.scan(layer_step, x, (stacked, *cache))
    return model.compute_logits(model.norm(x[:, -1])), cache


def _mask(columns: jax.Array, pad: jax.Array, num_columns: int, sliding_window: int | None) -> jax.Array:
    """[B, T, S]: the query at cache column ``columns[t]`` of row b sees key column s: a real token
    of its row, not after itself, and within the sliding window when the model has one."""
    keys = jnp.arange(num_columns)
    mask = (keys[None, None, :] >= pad[:, None, None]) & (keys[None, None, :] <= columns[None, :, None])
    if sliding_window is not None:
        mask &= keys[None, None, :] > columns[None, :, None] - sliding_window
    return mask


def _attention(attn, x: jax.Array, positions: jax.Array, mask: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array, start, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dense attention of [B, T, D] over the cache columns that ``mask`` [B, T, S] allows."""
    cfg = attn.cfg
    b, t, _ = x.shape
    q = jnp.einsum("btd,dnh->btnh", x, plain(attn.q_proj))
    k = jnp.einsum("btd,dkh->btkh", x, plain(attn.k_proj))
    v = jnp.einsum("btd,dkh->btkh", x, plain(attn.v_proj))
    if cfg.attention_bias:
        q, k, v = q + attn.q_bias[...], k + attn.k_bias[...], v + attn.v_bias[...]
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    flat = positions.reshape(-1)
    scale = rope_attention_factor(cfg)
    q = apply_rope(q.reshape(b * t, *q.shape[2:]), flat, inv_freq, scale).reshape(q.shape)
    k = apply_rope(k.reshape(b * t, *k.shape[2:]), flat, inv_freq, scale).reshape(k.shape)
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
    groups = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_cache, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * cfg.head_dim ** -0.5, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", probs, v_cache).reshape(b, t, cfg.num_heads, cfg.head_dim)
    return jnp.einsum("btnh,nhd->btd", o, plain(attn.o_proj)), k_cache, v_cache
