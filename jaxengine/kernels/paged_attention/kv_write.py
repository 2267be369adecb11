"""KV cache write as a Pallas kernel (Triton lowering; interpret mode on the CPU): the
alternative to the XLA scatter (``reference.write_kv``) that the engine uses. The GPU check times
both on the same batch; the engine switches to this one only if it measures faster.

Grid: (token block, KV head). A program stores ``block_tokens`` new rows of one head into their
cache slots; the caches are aliased to the outputs (donated, written in place, never copied).
The tokens are padded to whole blocks with slot 0, the null block's first slot, which padding
tokens already write to and nothing reads as data.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxengine.kernels.paged_attention.layout import as_stored, heads_apart

# Tokens per program by (head size, page size, dtype name): a program moves block_tokens rows of
# head_size elements. Starting points (about 4 KB per program); scripts/gpu_check.sh times others.
TUNED: dict[tuple[int, int, str], int] = {
    (64, 16, "bfloat16"): 32, (128, 16, "bfloat16"): 16, (64, 16, "float32"): 16, (128, 16, "float32"): 8,
}
DEFAULT_BLOCK_TOKENS = 16


def write_kv_pallas(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
                    *, block_tokens: int | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows [T, K, H] into caches [P, S, K*H] (or [P, S, K, H]) at their slots; same
    contract as ``reference.write_kv``. The caches come back in the shape they came in."""
    stored = k_cache.shape
    num_pages, page_size, num_kv_heads, head_size = heads_apart(k_cache, k.shape[-1]).shape
    if block_tokens is None:
        block_tokens = TUNED.get((head_size, page_size, k_cache.dtype.name), DEFAULT_BLOCK_TOKENS)
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_size) or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv: expected k, v [T, {num_kv_heads}, {head_size}] and slot_mapping [T]; got "
                         f"{k.shape}, {v.shape}, {slot_mapping.shape}")
    if head_size & (head_size - 1) or block_tokens & (block_tokens - 1):
        raise ValueError(f"write_kv: head size and block_tokens must be powers of two, got {head_size}, {block_tokens}")
    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    pad = -k.shape[0] % block_tokens
    # as_stored: an FP8 cache stored as bytes (the CPU) gets the rows' float8 bytes, not their values
    rows = [jnp.pad(as_stored(x, k_cache.dtype), ((0, pad), (0, 0), (0, 0))) for x in (k, v)]
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, pad))
    flat = jax.ShapeDtypeStruct((num_pages * page_size, num_kv_heads, head_size), k_cache.dtype)
    k_cache, v_cache = pl.pallas_call(
        functools.partial(_kernel, block_tokens=block_tokens),
        grid=(slots.shape[0] // block_tokens, num_kv_heads),
        out_shape=(flat, flat),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(),
        name="paged_kv_write",
    )(slots, *rows, k_cache.reshape(flat.shape), v_cache.reshape(flat.shape))
    return k_cache.reshape(stored), v_cache.reshape(stored)


def _triton_params():
    # Named explicitly: without compiler parameters a GPU pallas_call may pick Mosaic GPU.
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _kernel(slots_ref, k_ref, v_ref, k_cache_in, v_cache_in, k_cache_ref, v_cache_ref, *, block_tokens: int):
    del k_cache_in, v_cache_in                     # aliased to the outputs
    block, head = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(block * block_tokens, block_tokens)
    slots = slots_ref[rows]
    k_cache_ref[slots, head, :] = k_ref[rows, head, :]
    v_cache_ref[slots, head, :] = v_ref[rows, head, :]
