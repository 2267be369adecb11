"""Quantized weights, kept quantized in memory, and their matmul.

A ``QuantizedWeight`` stands for an f32 weight of the model's layout ([..contracted axes.., ..output
axes..], possibly stacked [L, ...] over layers) as integer values with a scale and an optional
offset per group of ``G`` consecutive elements along the last contracted axis:

    w = scale * q + offset           (per group and output column)

int8 values are signed (-127..127, no offset: symmetric); int4 values are 0..15 packed two a byte
along the grouped axis (element 2i in the low nibble, 2i+1 in the high one), with an offset (an
asymmetric range, as GGUF's Q4_1; a symmetric one such as Q4_0 is offset = -8 * scale). Their
scales and offsets are float16, as GGUF stores them, so a GGUF block converts exactly. fp8 values
are float8_e4m3fn with a float32 scale per group (as FP8 checkpoints store them; a per-channel or
per-tensor scale is one group the length of the axis, a block-wise one repeated along the output).

The matmul applies the scales in its epilogue: on a CPU through ``cpu_quantized_matmul.cc`` (every
format; the bytes read per step are the quantized ones), elsewhere, and on a mesh, by XLA: the layer's weight
dequantised then multiplied (``xla_quantized_dense``). A mixture of experts' stacked experts
([E, K, N] per layer) go the same two ways through ``grouped_quantized_dense``: the CPU kernel reads
only the experts some row chose; XLA dequantises the layer's experts and runs ``ragged_dot``.
On a CPU whose kernel multiplies bytes (AVX-512 VNNI and VBMI, or AVX2), a loaded model's int8 / int4
projections are laid out once as ``TiledWeight`` (``tile``): the blocks in the order the decode
product reads them, each group's scales beside its values, so a thread's share of a product is one
stream (``cpu_quantized_matmul.cc``, "tiles"). ``untile`` gives the ``QuantizedWeight`` back.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.cpu_build import built_library, register_kernel
from jaxengine.kernels.matmul.openblas import openblas_build

SOURCE = Path(__file__).with_name("cpu_quantized_matmul.cc")
# (values dtype, scale dtype) -> the CPU kernel's FFI target and handler symbol
TARGETS = {("int8", "float16"): "jaxengine_cpu_int8_matmul", ("uint8", "float16"): "jaxengine_cpu_int4_matmul",
           ("int8", "float32"): "jaxengine_cpu_int8_matmul_f32", ("uint8", "float32"): "jaxengine_cpu_int4_matmul_f32",
           ("float8_e4m3fn", "float32"): "jaxengine_cpu_fp8_matmul"}
SYMBOLS = {("int8", "float16"): "JaxengineCpuInt8Matmul", ("uint8", "float16"): "JaxengineCpuInt4Matmul",
           ("int8", "float32"): "JaxengineCpuInt8MatmulF32", ("uint8", "float32"): "JaxengineCpuInt4MatmulF32",
           ("float8_e4m3fn", "float32"): "JaxengineCpuFp8Matmul"}
# Several products of one x in one call (int8 / int4 only): the targets' names in the plural.
MANY_TARGETS = {key: target.replace("_matmul", "_matmuls") for key, target in TARGETS.items() if key[0] != "float8_e4m3fn"}
MANY_SYMBOLS = {key: symbol.replace("Matmul", "Matmuls") for key, symbol in SYMBOLS.items() if key[0] != "float8_e4m3fn"}
GROUPED_TARGETS = {key: target.replace("cpu_", "cpu_grouped_") for key, target in TARGETS.items()}
GROUPED_SYMBOLS = {key: symbol.replace("Cpu", "CpuGrouped") for key, symbol in SYMBOLS.items()}
TILED_TARGET, TILED_SYMBOL = "jaxengine_cpu_tiled_matmuls", "JaxengineCpuTiledMatmuls"
TILE = 16                           # columns of a tile
STEP_ROWS = 4                       # rows of q (bytes) in a step of a tile: one 64-byte word
SCALE_DTYPE = np.float16
BITS = (8, 4)


@dataclasses.dataclass(frozen=True)
class Format:
    """How a format's values and scales are stored."""
    bits: int
    values: np.dtype
    scale: np.dtype


# int8 / int4 with float16 scales (GGUF's, and the engine's own quantization, which rounds its
# scales first), or float32 ones ("-f32": checkpoints whose scales, or whose offsets -scale *
# zero point, float16 would round); fp8 with float32 scales.
FORMATS = {"int8": Format(8, np.dtype(np.int8), np.dtype(SCALE_DTYPE)),
           "int4": Format(4, np.dtype(np.uint8), np.dtype(SCALE_DTYPE)),
           "int8-f32": Format(8, np.dtype(np.int8), np.dtype(np.float32)),
           "int4-f32": Format(4, np.dtype(np.uint8), np.dtype(np.float32)),
           "fp8": Format(8, np.dtype(jnp.float8_e4m3fn), np.dtype(np.float32))}
FP8_MAX = 448.0                     # the largest float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """``q``: int8 or float8_e4m3fn [.., K, ..] (bits 8) or uint8 [.., K/2, ..] (bits 4, packed
    along the grouped axis); ``scale`` / ``offset``: [.., K/G, ..] (``FORMATS``); ``offset`` None: none. ``out_axes``: how
    many trailing axes are the matmul's output; the axes before them (after a stacking axis, if
    any) are contracted, and the last contracted one is grouped."""
    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    bits: int = dataclasses.field(metadata=dict(static=True))
    out_axes: int = dataclasses.field(default=1, metadata=dict(static=True))

    def layer(self, index) -> "QuantizedWeight":
        """The weight of one layer of a stacked [L, ...] weight."""
        return jax.tree.map(lambda a: a[index], self)

    @property
    def group(self) -> int:
        axis = -1 - self.out_axes
        return self.q.shape[axis] * (8 // self.bits) // self.scale.shape[axis]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TiledWeight:
    """An int8 / int4 ``QuantizedWeight`` laid out for the CPU kernel's decode product:
    ``blocks`` uint8 [(L,) N / 16, K / G, block], for each tile of 16 output columns and each group
    of G rows, the group's values as 64-byte words of 4 rows of q by 16 columns ([column][row]:
    4 int8 values, or 8 int4 ones, of a column a word), then its 16 scales and, with ``offset``, its
    16 offsets (``scale_dtype``). ``out_shape``: the output axes (N is their product)."""
    blocks: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True))
    scale_dtype: str = dataclasses.field(metadata=dict(static=True))
    offset: bool = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def layer(self, index) -> "TiledWeight":
        """The weight of one layer of a stacked [L, ...] weight."""
        return jax.tree.map(lambda a: a[index], self)

    @property
    def k(self) -> int:
        return self.blocks.shape[-2] * self.group


# ---------------------------------------------------------------- host side: quantize, pack
def quantize(w: np.ndarray, fmt: str, group: int, axis: int = -1, offset: bool | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The engine's reference quantization of ``w`` in groups of ``group`` along ``axis``:
    -> (values, scale, offset or None), values unpacked (int8; int4 as uint8 0..15; fp8). int8 is
    symmetric (scale = max|w| / 127); int4 asymmetric (scale = (max - min) / 15, offset = min),
    or symmetric with ``offset=False`` (values -8..7 shifted to 0..15, offset = -8 * scale); fp8
    symmetric (scale = max|w| / 448, float32, values rounded to nearest). Scales are rounded to
    their dtype before the values are computed, so dequantising reproduces them."""
    if fmt not in FORMATS:
        raise ValueError(f"quantization to {fmt!r}: supported {list(FORMATS)}")
    bits = FORMATS[fmt].bits

    def rounded(a) -> np.ndarray:
        return np.asarray(a, np.float32).astype(FORMATS[fmt].scale)
    w = np.moveaxis(np.asarray(w, np.float32), axis, -1)
    if w.shape[-1] % group or (bits == 4 and group % 2):
        raise ValueError(f"a group of {group} does not divide the axis of {w.shape[-1]} (int4: an even group)")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    offset = bits == 4 if offset is None else offset
    if fmt == "fp8":
        scale = (np.abs(g).max(-1) / FP8_MAX).astype(np.float32)
        values, zero = (g / _nonzero(scale)[..., None]).astype(FORMATS["fp8"].values), None
    elif offset:
        low, high = g.min(-1), g.max(-1)
        levels = 2 ** bits - 1
        scale, zero = rounded((high - low) / levels), rounded(low)
        values = np.clip(np.rint((g - zero[..., None]) / _nonzero(scale)[..., None]), 0, levels)
        if bits == 8:           # int8 values are signed: the range and the offset shift by 128 steps
            values, zero = values - 128, rounded(zero.astype(np.float32) + 128 * scale.astype(np.float32))
        values = values.astype(np.uint8 if bits == 4 else np.int8)
    else:
        top = 2 ** (bits - 1) - 1
        scale = rounded(np.abs(g).max(-1) / top)
        values = np.clip(np.rint(g / _nonzero(scale)[..., None]), -top - 1, top)
        if bits == 4:
            values, zero = (values + 8).astype(np.uint8), rounded(-8 * scale.astype(np.float32))
        else:
            values, zero = values.astype(np.int8), None
    back = functools.partial(np.moveaxis, source=-1, destination=axis)
    return (back(values.reshape(w.shape)), back(scale), None if zero is None else back(zero))


def dequantize_reference(values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
                         axis: int = -1) -> np.ndarray:
    """f32 of unpacked ``values`` with their scales (and offsets) per group along ``axis``."""
    group = values.shape[axis] // scale.shape[axis]
    w = values.astype(np.float32) * np.repeat(scale.astype(np.float32), group, axis=axis)
    return w if offset is None else w + np.repeat(offset.astype(np.float32), group, axis=axis)


def pack_int4(values: np.ndarray, axis: int) -> np.ndarray:
    """Values 0..15 -> bytes, two consecutive elements along ``axis`` a byte (low nibble first)."""
    v = np.moveaxis(np.asarray(values, np.uint8), axis, 0)
    if v.shape[0] % 2:
        raise ValueError(f"int4 packing needs an even axis, not {v.shape[0]}")
    return np.moveaxis(v[0::2] | (v[1::2] << 4), 0, axis)


def unpack_int4_host(packed: np.ndarray, axis: int) -> np.ndarray:
    p = np.moveaxis(np.asarray(packed, np.uint8), axis, 0)
    out = np.empty((2 * p.shape[0], *p.shape[1:]), np.uint8)
    out[0::2], out[1::2] = p & 15, p >> 4
    return np.moveaxis(out, 0, axis)


def can_tile(w: QuantizedWeight) -> bool:
    """Whether ``tile`` lays out ``w``: int8 or int4 values with float16 or float32 scales, its
    output a whole number of tiles, its groups whole steps."""
    n = math.prod(w.q.shape[w.q.ndim - w.out_axes:])
    step = STEP_ROWS * (8 // w.bits)
    return (w.q.dtype.name in ("int8", "uint8") and w.scale.dtype.name in ("float16", "float32")
            and n % TILE == 0 and w.group % step == 0)


def tile(w: QuantizedWeight, stacked: bool) -> TiledWeight:
    """``w`` (stacked [L, ...] over layers, or not) as a ``TiledWeight``, laid out by the kernel's
    library on the host (at memory speed; XLA's transposes of these shapes take ten times longer)."""
    out_shape = tuple(w.q.shape[w.q.ndim - w.out_axes:])
    n = math.prod(out_shape)
    layers = w.q.shape[0] if stacked else 1
    q = np.ascontiguousarray(np.asarray(w.q)).view(np.uint8)
    scale = np.ascontiguousarray(np.asarray(w.scale))
    offset = None if w.offset is None else np.ascontiguousarray(np.asarray(w.offset).astype(scale.dtype))
    rows, groups = q.size // (layers * n), scale.size // (layers * n)
    block = rows // groups * 16 + TILE * scale.itemsize * (1 if offset is None else 2)
    blocks = np.empty((layers, n // TILE, groups, block), np.uint8)
    pointer = ctypes.c_void_p
    if _library().JaxengineCpuTile(q.ctypes.data_as(pointer), scale.ctypes.data_as(pointer),
                                   None if offset is None else offset.ctypes.data_as(pointer), ctypes.c_int64(layers),
                                   ctypes.c_int64(rows), ctypes.c_int64(n), ctypes.c_int64(groups),
                                   ctypes.c_int64(scale.itemsize), blocks.ctypes.data_as(pointer)) != 0:
        raise ValueError(f"tile: a weight of {rows} rows of q by {n} columns in {groups} groups does not tile")
    return TiledWeight(jnp.asarray(blocks if stacked else blocks[0]), w.bits, scale.dtype.name, offset is not None,
                       w.group, out_shape)


def untile(w: TiledWeight) -> QuantizedWeight:
    """The ``QuantizedWeight`` ``w`` was laid out from, its output axes flattened ([(L,) K / P, N])."""
    lead, (tiles, groups, block) = w.blocks.shape[:-3], w.blocks.shape[-3:]
    size = np.dtype(w.scale_dtype).itemsize
    value_bytes = block - TILE * size * (2 if w.offset else 1)
    words = w.blocks[..., :value_bytes].reshape(*lead, tiles, -1, TILE, STEP_ROWS)
    q = jnp.moveaxis(words, (-3, -1, -4, -2), (-4, -3, -2, -1)).reshape(*lead, -1, tiles * TILE)
    if w.bits == 8:
        q = jax.lax.bitcast_convert_type(q, jnp.int8)

    def scales(start: int) -> jax.Array:
        part = w.blocks[..., start:start + TILE * size].reshape(*lead, tiles, groups, TILE, size)
        values = jax.lax.bitcast_convert_type(part, jnp.dtype(w.scale_dtype))
        return jnp.moveaxis(values, -3, -2).reshape(*lead, groups, tiles * TILE)

    offset = scales(value_bytes + TILE * size) if w.offset else None
    return QuantizedWeight(q, scales(value_bytes), offset, w.bits)


def _nonzero(scale: np.ndarray) -> np.ndarray:
    s = scale.astype(np.float32)
    return np.where(s == 0, 1.0, s)


# ---------------------------------------------------------------- device side: the matmul
def unpack_int4(q: jax.Array, axis: int) -> jax.Array:
    """uint8 bytes -> the int4 values 0..15 (uint8), the axis doubled."""
    axis %= q.ndim
    both = jnp.stack([q & 15, q >> 4], axis=axis + 1)
    return both.reshape(*q.shape[:axis], 2 * q.shape[axis], *q.shape[axis + 1:])


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The f32 weight (one layer's, or a stack's) that ``w`` stands for."""
    axis = -1 - w.out_axes                          # from the end: a stacking axis may lead
    values = unpack_int4(w.q, axis) if w.bits == 4 else w.q
    group = values.shape[axis] // w.scale.shape[axis]
    out = values.astype(dtype) * jnp.repeat(w.scale.astype(dtype), group, axis=axis)
    if w.offset is not None:
        out = out + jnp.repeat(w.offset.astype(dtype), group, axis=axis)
    return out


def xla_quantized_dense(x: jax.Array, w: QuantizedWeight, layer: jax.Array | None = None) -> jax.Array:
    """x [T, K] @ the layer's weight, dequantised by XLA (only the layer's slice of a stack)."""
    weight = dequantize(w if layer is None else w.layer(layer), x.dtype)
    out_axes = weight.shape[weight.ndim - w.out_axes:]
    return jnp.tensordot(x, weight.reshape(-1, *out_axes), axes=1)


def quantized_dense(x: jax.Array, w: QuantizedWeight, layer: jax.Array | None = None) -> jax.Array:
    """x [T, K] @ w (w[layer] when stacked) -> [T, ..output axes..]: the CPU kernel where it
    serves (int8, int4, fp8), else XLA's dequantise-and-dot."""
    if not serves(x, w):
        return xla_quantized_dense(x, w, layer)
    operands, out_axes = _kernel_operands(w, layer)
    call = jax.ffi.ffi_call(TARGETS[w.q.dtype.name, w.scale.dtype.name], jax.ShapeDtypeStruct((x.shape[0], math.prod(out_axes)), jnp.float32),
                            vmap_method="sequential")
    out = call(x, *operands, jnp.asarray(0 if layer is None else layer, jnp.int32))
    return out.reshape(x.shape[0], *out_axes)


def _kernel_operands(w: QuantizedWeight, layer: jax.Array | None) -> tuple[list[jax.Array], tuple[int, ...]]:
    """The CPU kernel's q, scale and offset ([L, K / P or K / G, N]: bitcasts of the stack; a
    weight not stacked gets a layer axis; no offset: an empty array), and the output axes."""
    stacked = w if layer is not None else jax.tree.map(lambda a: a[None], w)
    out_axes = stacked.q.shape[stacked.q.ndim - w.out_axes:]
    def flat(a: jax.Array) -> jax.Array:
        return a.reshape(a.shape[0], -1, math.prod(out_axes))

    offset = jnp.zeros((0,), w.scale.dtype) if w.offset is None else flat(stacked.offset)
    return [flat(stacked.q), flat(stacked.scale), offset], out_axes


def quantized_dense_many(x: jax.Array, ws: list[QuantizedWeight], layer: jax.Array | None = None) -> list[jax.Array]:
    """``[quantized_dense(x, w, layer) for w in ws]``, as one call of the CPU kernel where it serves
    them all and they share a format (x's int8 terms written once, one job for the threads)."""
    key = (ws[0].q.dtype.name, ws[0].scale.dtype.name)
    alike = all((w.q.dtype.name, w.scale.dtype.name) == key and (w.offset is None) == (ws[0].offset is None)
                and w.bits == ws[0].bits for w in ws)
    if not (alike and key in MANY_TARGETS and all(serves(x, w) for w in ws)):
        return [quantized_dense(x, w, layer) for w in ws]
    operands, out_axes = zip(*(_kernel_operands(w, layer) for w in ws))
    shapes = [jax.ShapeDtypeStruct((x.shape[0], math.prod(axes)), jnp.float32) for axes in out_axes]
    outs = jax.ffi.ffi_call(MANY_TARGETS[key], shapes, vmap_method="sequential")(
        x, jnp.asarray(0 if layer is None else layer, jnp.int32), *(a for each in operands for a in each))
    return [out.reshape(x.shape[0], *axes) for out, axes in zip(outs, out_axes)]


def tiled_dense_many(x: jax.Array, ws: list[TiledWeight], layer: jax.Array | None = None) -> list[jax.Array]:
    """``[x @ w for w in ws]`` (w[layer] when stacked) -> [T, ..output axes..] each: one call of
    the CPU kernel where it serves them all and they share a format, else XLA's product of each
    weight untiled."""
    alike = all((w.bits, w.scale_dtype, w.offset, w.group, w.k) == (ws[0].bits, ws[0].scale_dtype, ws[0].offset,
                                                                     ws[0].group, ws[0].k) for w in ws)
    if not (alike and jax.default_backend() == "cpu" and x.ndim == 2 and x.dtype == jnp.float32 and tiles_available()):
        return [xla_quantized_dense(x, untile(w), layer).reshape(x.shape[0], *w.out_shape) for w in ws]
    stacked = [w.blocks if layer is not None else w.blocks[None] for w in ws]
    shapes = [jax.ShapeDtypeStruct((x.shape[0], math.prod(w.out_shape)), jnp.float32) for w in ws]
    w0 = ws[0]
    outs = jax.ffi.ffi_call(TILED_TARGET, shapes, vmap_method="sequential")(
        x, jnp.asarray(0 if layer is None else layer, jnp.int32), *stacked, bits=np.int64(w0.bits),
        scale_bytes=np.int64(np.dtype(w0.scale_dtype).itemsize), offset=w0.offset, group=np.int64(w0.group))
    return [out.reshape(x.shape[0], *w.out_shape) for out, w in zip(outs, ws)]


def tiled_dense(x: jax.Array, w: TiledWeight, layer: jax.Array | None = None) -> jax.Array:
    """x [T, K] @ w (w[layer] when stacked) -> [T, ..output axes..]."""
    return tiled_dense_many(x, [w], layer)[0]


def xla_grouped_quantized_dense(x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array,
                                layer: jax.Array | None = None) -> jax.Array:
    """Rows of x [M, K] sorted by group, group g times expert g of w ([E, K, N], or stacked with
    ``layer``) -> [M, N]: the layer's experts dequantised by XLA, then ``ragged_dot``."""
    weight = dequantize(w if layer is None else w.layer(layer), x.dtype)
    return jax.lax.ragged_dot(x, weight, group_sizes.astype(jnp.int32))


def grouped_quantized_dense(x: jax.Array, w: QuantizedWeight, group_sizes: jax.Array,
                            layer: jax.Array | None = None) -> jax.Array:
    """``xla_grouped_quantized_dense``'s product, through the CPU kernel where it serves: only the
    experts some row chose are read, quantized, from the stack in place."""
    if not serves(x, w):
        return xla_grouped_quantized_dense(x, w, group_sizes, layer)
    stacked = w if layer is not None else jax.tree.map(lambda a: a[None], w)
    offset = jnp.zeros((0,), w.scale.dtype) if w.offset is None else stacked.offset
    call = jax.ffi.ffi_call(GROUPED_TARGETS[w.q.dtype.name, w.scale.dtype.name],
                            jax.ShapeDtypeStruct((x.shape[0], stacked.q.shape[-1]), jnp.float32), vmap_method="sequential")
    return call(x, stacked.q, stacked.scale, offset, group_sizes.astype(jnp.int32),
                jnp.asarray(0 if layer is None else layer, jnp.int32))


def serves(x: jax.Array, w: QuantizedWeight) -> bool:
    return (jax.default_backend() == "cpu" and x.ndim == 2 and x.dtype == jnp.float32
            and (w.q.dtype.name, w.scale.dtype.name) in TARGETS and available())


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernel's library, for its plain C functions (built by ``available()``)."""
    return ctypes.CDLL(str(built_library(SOURCE, **openblas_build())))


@functools.cache
def tiles_available() -> bool:
    """Whether the CPU kernel multiplies tiled weights here (it is built for a CPU with AVX-512
    VNNI and VBMI, or with AVX2): the loader lays weights out as tiles only then."""
    if not available():
        return False
    return bool(_library().JaxengineCpuTiles()) and register_kernel(SOURCE, TILED_SYMBOL, TILED_TARGET,
                                                                 "CPU tiled matmul", **openblas_build())


@functools.cache
def available() -> bool:
    build = openblas_build()
    return build is not None and all(
        register_kernel(SOURCE, symbols[key], targets[key], f"CPU {what}{key[0]} matmul", **build)
        for symbols, targets, what in ((SYMBOLS, TARGETS, ""), (GROUPED_SYMBOLS, GROUPED_TARGETS, "grouped "),
                                       (MANY_SYMBOLS, MANY_TARGETS, "several "))
        for key in symbols)
