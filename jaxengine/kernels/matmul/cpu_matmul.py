"""The model's dense projections (and a mixture of experts' grouped ones) on the CPU through OpenBLAS (``cpu_matmul.cc``, called through
``jax.ffi``). XLA's CPU dot runs a step's skinny matmuls (a few to a few dozen token rows against a
weight matrix) at a third to a half of OpenBLAS's speed (BENCHMARKS.md, "the matmuls of a step
through OpenBLAS"). OpenBLAS comes from the ``scipy-openblas32`` wheel, the build NumPy and SciPy
are built against, with its headers.

The kernel is built on first use (``kernels.cpu_build``). Without a compiler or the wheel, or with
``JAXENGINE_CPU_MATMUL_KERNEL=0``, ``available()`` is False and XLA's dot serves (a warning says
why, once). It serves f32 on a CPU backend only; a sharded model keeps XLA's dot, whose partitioner
splits it over the mesh (``models.mesh.shard_kernels``).
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxengine.kernels.cpu_build import register_kernel
from jaxengine.kernels.matmul.openblas import openblas_build
from jaxengine.kernels.matmul.quantized import (QuantizedWeight, TiledWeight, grouped_quantized_dense, quantized_dense,
                                                quantized_dense_many, tiled_dense, tiled_dense_many, untile,
                                                xla_grouped_quantized_dense, xla_quantized_dense)

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxengine_cpu_matmul"
GROUPED_TARGET = "jaxengine_cpu_grouped_matmul"


def xla_dense(x: jax.Array, w: jax.Array | QuantizedWeight, layer: jax.Array | None = None) -> jax.Array:
    """x [T, D] @ w [D, ...] -> [T, ...] by XLA's dot; with ``layer``, w is stacked [L, D, ...]. A
    quantized weight is dequantised (the layer's slice only) and multiplied."""
    if isinstance(w, TiledWeight):
        return xla_quantized_dense(x, untile(w), layer).reshape(x.shape[0], *w.out_shape)
    if isinstance(w, QuantizedWeight):
        return xla_quantized_dense(x, w, layer)
    return jnp.tensordot(x, w if layer is None else w[layer], axes=1)


def dense(x: jax.Array, w: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """x [T, D] @ w [D, ...] -> [T, ...], or x @ w[layer] with w stacked [L, D, ...] (the layer
    scan's weights, read in place): through OpenBLAS where it serves, else XLA's dot. The weight's
    trailing axes are one row-major block, so flattening them costs nothing. A quantized weight
    goes to ``quantized_dense``, a tiled one to ``tiled_dense``."""
    if isinstance(w, TiledWeight):
        return tiled_dense(x, w, layer)
    if isinstance(w, QuantizedWeight):
        return quantized_dense(x, w, layer)
    if not serves(x, w):
        return xla_dense(x, w, layer)
    stacked = w if layer is not None else w[None]
    out = matmul(x, stacked.reshape(*stacked.shape[:2], -1), 0 if layer is None else layer)
    return out.reshape(x.shape[0], *stacked.shape[2:])


def dense_each(fn, x: jax.Array, ws, layer: jax.Array | None = None) -> list[jax.Array]:
    """``[fn(x, w, layer) for w in ws]``: the same x against several weights (a layer's q, k and v
    projections, its gate and up). Where ``fn`` is ``dense`` and the weights are quantized alike,
    one call of the CPU kernel computes them all (x's terms written once, one job for the threads)."""
    if fn is dense and len(ws) > 1 and all(isinstance(w, TiledWeight) for w in ws):
        return tiled_dense_many(x, list(ws), layer)
    if fn is dense and len(ws) > 1 and all(isinstance(w, QuantizedWeight) for w in ws):
        return quantized_dense_many(x, list(ws), layer)
    return [fn(x, w, layer) for w in ws]


def xla_grouped_dense(x: jax.Array, w: jax.Array | QuantizedWeight, group_sizes: jax.Array,
                      layer: jax.Array | None = None) -> jax.Array:
    """Rows of x [M, K] sorted by group, group g times w[g] ([E, K, N], or stacked [L, E, K, N] with
    ``layer``) -> [M, N]; rows past the groups are zero. XLA's ``ragged_dot``: on a CPU it is
    rewritten densely (every row times every expert), elsewhere it is XLA's grouped matmul. Quantized
    experts are dequantised (the layer's only) and multiplied."""
    if isinstance(w, QuantizedWeight):
        return xla_grouped_quantized_dense(x, w, group_sizes, layer)
    return jax.lax.ragged_dot(x, w if layer is None else w[layer], group_sizes.astype(jnp.int32))


def grouped_dense(x: jax.Array, w: jax.Array | QuantizedWeight, group_sizes: jax.Array,
                  layer: jax.Array | None = None) -> jax.Array:
    """``xla_grouped_dense``'s product, through OpenBLAS where it serves: only the experts some
    row chose are read and multiplied, from the stack in place. Quantized experts go to
    ``grouped_quantized_dense``."""
    if isinstance(w, QuantizedWeight):
        return grouped_quantized_dense(x, w, group_sizes, layer)
    if not serves(x, w):
        return xla_grouped_dense(x, w, group_sizes, layer)
    stacked = w if layer is not None else w[None]
    return grouped_matmul(x, stacked, group_sizes, 0 if layer is None else layer)


def serves(x: jax.Array, w: jax.Array) -> bool:
    return (jax.default_backend() == "cpu" and x.ndim == 2 and x.dtype == jnp.float32 and w.dtype == jnp.float32
            and available())


def matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0) -> jax.Array:
    """x [M, K] f32 @ w[layer] -> [M, N] f32 through the kernel; w is [L, K, N]."""
    if not available():
        raise RuntimeError("the CPU matmul kernel is not available (see the warning logged)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, jnp.asarray(layer, jnp.int32))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, layer: jax.Array | int = 0) -> jax.Array:
    """x [M, K] f32 (rows sorted by group) grouped times w[layer] [E, K, N] -> [M, N] f32 through
    the kernel; w is [L, E, K, N], group_sizes [E]."""
    if not available():
        raise RuntimeError("the CPU matmul kernel is not available (see the warning logged)")
    call = jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[3]), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, group_sizes.astype(jnp.int32), jnp.asarray(layer, jnp.int32))


@functools.cache
def available() -> bool:
    build = openblas_build()
    return (build is not None
            and register_kernel(SOURCE, "JaxengineCpuMatmul", TARGET, "CPU matmul", **build)
            and register_kernel(SOURCE, "JaxengineCpuGroupedMatmul", GROUPED_TARGET, "CPU grouped matmul", **build))
