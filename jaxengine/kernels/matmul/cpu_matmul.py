"""The model's dense projections (and a mixture of experts' grouped ones) on the CPU through OpenBLAS (``cpu_matmul.cc``, called through
``jax.ffi``). XLA's CPU dot runs a step's skinny matmuls (a few to a few dozen token rows against a
weight matrix) at a third to a half of OpenBLAS's speed (BENCHMARKS.md, "the matmuls of a step
through OpenBLAS"). OpenBLAS comes from the ``scipy-openblas32`` wheel, the build NumPy and SciPy
are built against, with its headers.

The kernel is built on first use (``kernels.cpu_build``). Without a compiler or the wheel, or with the
engine option ``cpu_matmul_kernels`` off (``openblas.use_cpu_matmul_kernels``), ``available()`` is
False and XLA's dot serves (a warning says why, once). It serves f32 on a CPU backend only; a sharded model keeps XLA's dot, whose partitioner
splits it over the mesh (``models.mesh.shard_kernels``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.cpu_build import register_kernel
from jaxengine.kernels.matmul.openblas import openblas_build
from jaxengine.kernels.matmul.quantized import (QuantizedWeight, TiledWeight, grouped_quantized_dense, quantized_dense,
                                                quantized_dense_many, tiled_dense, tiled_dense_many, untile,
                                                xla_grouped_quantized_dense, xla_quantized_dense)

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxengine_cpu_matmul"
GROUPED_TARGET = "jaxengine_cpu_grouped_matmul"
PANEL_TARGET = "jaxengine_cpu_panel_matmul"
PANEL = 32                                # a panel's columns (``kPanel`` in cpu_gemm.h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """A float32 weight [(L,) K, N] laid out for the CPU matmul kernel: ``panels`` [(L,) N / PANEL,
    K, PANEL], each strip of PANEL output columns one contiguous block, which the kernel streams
    front to back and multiplies into a block of rows from its registers (``cpu_gemm.h``), where
    the row-major weight would be read PANEL columns at a time, a row apart. ``out_shape``: the
    output axes (N is their product); K is the contracted axes flattened."""
    panels: jax.Array
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def k(self) -> int:
        return self.panels.shape[-2]


def can_panel(shape: tuple[int, ...], out_axes: int) -> bool:
    """Whether a weight of ``shape`` (its last ``out_axes`` axes the output's) lays out as panels."""
    return 0 < out_axes < len(shape) and math.prod(shape[len(shape) - out_axes:]) % PANEL == 0


def panel(w, out_axes: int, stacked: bool) -> PanelWeight:
    """``w`` [(L,) ..contracted axes.., ..its last ``out_axes`` axes, the output's..] (float32) as a
    ``PanelWeight``, laid out on the host."""
    a = np.asarray(w, np.float32)
    lead = a.shape[:1] if stacked else ()
    out_shape = a.shape[a.ndim - out_axes:]
    if not can_panel(a.shape[len(lead):], out_axes):
        raise ValueError(f"panel: a weight of shape {a.shape} with {out_axes} output axes does not lay out as "
                         f"panels of {PANEL} columns")
    n = math.prod(out_shape)
    strips = a.reshape(*lead, -1, n // PANEL, PANEL)                 # [(L,) K, N / PANEL, PANEL]
    return PanelWeight(jnp.asarray(np.ascontiguousarray(np.moveaxis(strips, -2, -3))), tuple(out_shape))


def unpanel(w: PanelWeight) -> jax.Array:
    """The row-major weight ``w`` was laid out from: [(L,) K, ..output axes..]."""
    rows = jnp.moveaxis(w.panels, -3, -2)            # [(L,) K, N / PANEL, PANEL]
    return rows.reshape(*rows.shape[:-3], rows.shape[-3], *w.out_shape)


def panel_dense(x: jax.Array, w: PanelWeight, layer: jax.Array | None = None) -> jax.Array:
    """x [T, K] @ w (w[layer] when stacked) -> [T, ..output axes..], through the kernel on a CPU,
    else XLA's dot on the weight laid back out."""
    if not (jax.default_backend() == "cpu" and x.ndim == 2 and x.dtype == jnp.float32 and available()):
        return xla_dense(x, w, layer)
    stacked = w.panels if layer is not None else w.panels[None]
    call = jax.ffi.ffi_call(PANEL_TARGET, jax.ShapeDtypeStruct((x.shape[0], stacked.shape[1] * PANEL), jnp.float32),
                            vmap_method="sequential")
    out = call(x, stacked, jnp.asarray(0 if layer is None else layer, jnp.int32))
    return out.reshape(x.shape[0], *w.out_shape)


def xla_dense(x: jax.Array, w: jax.Array | QuantizedWeight, layer: jax.Array | None = None) -> jax.Array:
    """x [T, D] @ w [D, ...] -> [T, ...] by XLA's dot; with ``layer``, w is stacked [L, D, ...]. A
    quantized weight is dequantised (the layer's slice only) and multiplied."""
    if isinstance(w, TiledWeight):
        return xla_quantized_dense(x, untile(w), layer).reshape(x.shape[0], *w.out_shape)
    if isinstance(w, QuantizedWeight):
        return xla_quantized_dense(x, w, layer)
    if isinstance(w, PanelWeight):
        w = unpanel(w)
    return jnp.tensordot(x, w if layer is None else w[layer], axes=1)


def dense(x: jax.Array, w: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """x [T, D] @ w [D, ...] -> [T, ...], or x @ w[layer] with w stacked [L, D, ...] (the layer
    scan's weights, read in place): through OpenBLAS where it serves, else XLA's dot. The weight's
    trailing axes are one row-major block, so flattening them costs nothing. A quantized weight
    goes to ``quantized_dense``, a tiled one to ``tiled_dense``, one laid out as panels to
    ``panel_dense``."""
    if isinstance(w, PanelWeight):
        return panel_dense(x, w, layer)
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
            and register_kernel(SOURCE, "JaxengineCpuGroupedMatmul", GROUPED_TARGET, "CPU grouped matmul", **build)
            and register_kernel(SOURCE, "JaxengineCpuPanelMatmul", PANEL_TARGET, "CPU panel matmul", **build))
