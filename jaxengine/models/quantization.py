"""Weights kept quantized in the model: which ones, in which layout, and how a checkpoint's
tensors become them.

A quantized weight of kind ``q_proj`` (and so on) is a ``QuantizedParam`` module in place of the
plain parameter: its ``q``, ``scale`` and ``offset`` parameters, each split over the mesh as the
plain one would be, read together as a ``kernels.matmul.quantized.QuantizedWeight``. Groups run
along the weight's last contracted axis: the model width for q/k/v, gate and up; the MLP width for
down; the head size for o_proj (a group never crosses heads, so heads split over the mesh cleanly).
The embedding is kept as [D, V] when quantized (the LM head's layout; a token's row is a column).

Checkpoint readers present a quantized tensor ``X`` (Hugging Face name and [out, in] layout) as
its unpacked integer values under ``X``, with ``X:scale`` and ``X:offset`` [out, in / G]
beside it; ``models.hf_tensors`` maps the three onto the module's parameters (packing int4 there).
A GGUF's blocks are read that way (``models.gguf``); an unquantized checkpoint is quantized while
it loads (``QuantizingSource``, the ``quantization`` option).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul.quantized import (FORMATS, TILE, QuantizedWeight, TiledWeight, can_tile, dequantize,
                                                quantize, tile, tiles_available, untile)
from jaxengine.models.config import ModelConfig
from jaxengine.models.hf_tensors import EXPERT_KINDS, QUANTIZABLE, Index, TensorSource

PARTS = ("q", "scale", "offset", "blocks", "panels")   # "blocks": tiled (``tile_for_cpu``); "panels": ``models.panels``
SCHEMES = ("fp8", "int8", "int4")   # quantized while loading; "none": whatever is stored, dequantised
GROUP = 128                         # the largest group of online int4 (smaller where an axis needs it)


def grouped_sizes(cfg: ModelConfig, kind: str) -> set[int]:
    """The lengths of the grouped axis of every weight of ``kind`` in the model."""
    if kind in EXPERT_KINDS:
        return set() if not cfg.is_moe else {cfg.moe_intermediate_size if kind == "experts.down_proj" else cfg.hidden_size}
    if kind == "o_proj":
        return {cfg.head_dim}
    if kind != "down_proj":
        return {cfg.hidden_size}
    sizes = {cfg.intermediate_size} if not cfg.is_moe or cfg.dense_layers else set()
    return sizes | ({cfg.shared_expert_intermediate_size} if cfg.shared_expert_intermediate_size else set())


def online_plan(cfg: ModelConfig, scheme: str, split: int = 1) -> tuple[tuple[str, str, int, bool], ...]:
    """``ModelConfig.quantization`` for quantizing an unquantized checkpoint while it loads: fp8
    and int8 per output channel (symmetric; o_proj per head), int4 in groups of up to 128 with an offset.
    down_proj's grouped axis is split ``split`` ways over the mesh, so its groups are of up to 128
    in both schemes, within a device's share: the same weights at any split where the share is a
    multiple of 128. A mixture of experts' routed experts are quantized as the dense projections
    are (their down projection's grouped axis, the expert width, split as down_proj's)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization: {scheme!r} is not supported (supported: {[*SCHEMES, 'none']})")
    plan = []
    for kind in QUANTIZABLE:
        if kind == "lm_head" and cfg.tie_word_embeddings:
            continue
        down = kind in ("down_proj", "experts.down_proj")
        sizes = {size // split if down else size for size in grouped_sizes(cfg, kind)}
        if not sizes:
            continue
        whole = math.gcd(*sizes)
        if scheme != "int4" and not down:
            plan.append((kind, scheme, whole, False))
            continue
        groups = [g for g in range(2, GROUP + 1, 2) if whole % g == 0]
        if not groups:
            raise ValueError(f"quantization {scheme}: the {kind} axis of {whole} has no even group")
        plan.append((kind, scheme, max(groups), scheme == "int4"))
    return tuple(plan)


class QuantizedParam(nnx.Module):
    """A weight of ``shape`` (per layer) kept quantized; ``self[...]`` is its ``QuantizedWeight``."""

    def __init__(self, shape: tuple[int, ...], spec: tuple[str, int, bool], out_axes: int, axes: tuple) -> None:
        fmt, group, offset = spec
        stored = FORMATS[fmt]
        grouped = len(shape) - 1 - out_axes

        def along(divisor: int) -> tuple[int, ...]:
            return (*shape[:grouped], shape[grouped] // divisor, *shape[grouped + 1:])

        def param(shape, dtype) -> nnx.Param:
            return nnx.Param(jnp.zeros(shape, dtype), out_sharding=axes, eager_sharding=False)

        self.q = param(along(2) if stored.bits == 4 else shape, stored.values)
        self.scale = param(along(group), stored.scale)
        if offset:
            self.offset = param(along(group), stored.scale)
        self.bits, self.out_axes = stored.bits, out_axes

    def __getitem__(self, index) -> QuantizedWeight | TiledWeight:
        if hasattr(self, "blocks"):
            return dataclasses.replace(self.tiled, blocks=self.blocks[index])
        offset = self.offset[index] if hasattr(self, "offset") else None
        return QuantizedWeight(self.q[index], self.scale[index], offset, self.bits, self.out_axes)

    def tile(self, stacked: bool) -> None:
        """Lay the weight out as the CPU kernel's tiles (``TiledWeight``), in place of q, scale
        and offset."""
        tiled = tile(self[...], stacked)
        self.blocks = nnx.Param(tiled.blocks)
        self.tiled = dataclasses.replace(tiled, blocks=None)
        for part in ("q", "scale", "offset"):
            if hasattr(self, part):
                delattr(self, part)


# The weights laid out as tiles for the CPU's decode product: the layers' projections and the LM
# head (a quantized embedding, [D, V], is one; a token's column is gathered from its tile), not a
# mixture's routed experts (read by expert).
TILED_KINDS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                         "lm_head"})
_HEADED = ("q_proj", "k_proj", "v_proj", "o_proj")        # a layer's weight has 3 axes (heads among them), else 2


def tile_for_cpu(model: nnx.Module, dtype, devices: int) -> int:
    """Lay ``model``'s int8 / int4 projections out as the CPU kernel's tiles, where the kernel
    reads them (a float32 model on one CPU device whose kernel multiplies bytes); returns how
    many weights were laid out. The stacked layers' weights ([L, ...]) are tiled per layer."""
    if not (jax.default_backend() == "cpu" and devices == 1 and jnp.dtype(dtype) == jnp.float32
            and tiles_available()):
        return 0
    count = 0
    for path, node in list(nnx.iter_graph(model)):
        if (isinstance(node, QuantizedParam) and not hasattr(node, "blocks") and path and path[-1] in TILED_KINDS
                and "experts" not in path and can_tile(node[...])):
            node.tile(stacked=node.q.ndim > (3 if path[-1] in _HEADED else 2))
            count += 1
    return count


def gather_columns(w: QuantizedWeight | TiledWeight, ids) -> jnp.ndarray:
    """Columns ``ids`` of a quantized [D, V] embedding, dequantised -> [T, D] (f32). Tiled: the
    tiles holding them, untiled, then their columns."""
    if isinstance(w, TiledWeight):
        tiles = untile(dataclasses.replace(w, blocks=jnp.take(w.blocks, ids // TILE, axis=0)))
        columns = jnp.arange(ids.shape[0]) * TILE + ids % TILE          # each token's column of its tile
        return dequantize(jax.tree.map(lambda a: jnp.take(a, columns, axis=-1), tiles)).T
    picked = QuantizedWeight(jnp.take(w.q, ids, axis=-1), jnp.take(w.scale, ids, axis=-1),
                             None if w.offset is None else jnp.take(w.offset, ids, axis=-1), w.bits, w.out_axes)
    return dequantize(picked).T


# ---------------------------------------------------------------- quantizing while loading
_KIND = re.compile(r"(?:.*\.)?(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight|"
                   r"model\.(embed_tokens)\.weight|(lm_head)\.weight")
_STACKED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)")


def kind_of(name: str) -> str | None:
    """The kind of weight a Hugging Face tensor name is, if it is one that can be quantized: routed
    experts under their stacked names (``models.expert_tensors``), not one expert's tensor."""
    if m := _STACKED_EXPERTS.fullmatch(name):
        return f"experts.{m.group(1)}"
    m = None if ".experts." in name else _KIND.fullmatch(name)
    return next(g for g in m.groups() if g) if m else None


def split_part(name: str) -> tuple[str, str]:
    """``X:scale`` -> (``X``, ``scale``); ``X`` -> (``X``, "")."""
    base, _, part = name.partition(":")
    return base, part


class QuantizingSource:
    """An unquantized checkpoint's tensors with those ``cfg.quantization`` names quantized on
    read, presented as a quantized checkpoint's (values, ``:scale``, ``:offset``). A slice reads
    the whole groups it touches; the last slice's quantization is kept for its other parts."""

    def __init__(self, source: TensorSource, cfg: ModelConfig) -> None:
        self.source = source
        self.specs = {name: spec for name in source.names()
                      if (kind := kind_of(name)) and (spec := cfg.quant_spec(kind))}
        self._last: tuple | None = None

    def names(self) -> Iterable[str]:
        for name in self.source.names():
            yield name
            if spec := self.specs.get(name):
                yield f"{name}:scale"
                if spec[2]:
                    yield f"{name}:offset"

    def shape(self, name: str) -> tuple[int, ...]:
        base, part = split_part(name)
        shape = self.source.shape(base)
        return (*shape[:-1], shape[-1] // self.specs[base][1]) if part else shape

    def describe(self, name: str) -> str:
        base, part = split_part(name)
        inner = self.source.describe(base) if hasattr(self.source, "describe") else base
        return f"{inner} ({part or 'values'} of its quantization)" if base in self.specs else inner

    def read(self, name: str, index: Index) -> np.ndarray:
        base, part = split_part(name)
        if base not in self.specs:
            return self.source.read(name, index)
        fmt, group, offset = self.specs[base]
        *lead, cols = index
        first, last = (cols.start, cols.stop) if part else (cols.start // group, -(-cols.stop // group))
        key = (base, tuple((s.start, s.stop) for s in lead), first, last)
        if self._last is None or self._last[0] != key:
            w = self.source.read(base, (*lead, slice(first * group, last * group)))
            self._last = (key, quantize(w, fmt, group, axis=-1, offset=offset))
        values, scale, zero = self._last[1]
        if part == "scale":
            return scale
        if part == "offset":
            return zero
        return values[..., cols.start - first * group:cols.stop - first * group]


# Parameters a model may declare float32 whatever its dtype: DeepSeek-V3's router and its
# score-correction bias (a bfloat16 bias rounds coarsely enough to change which experts win).
FLOAT32_PARAMS = ("router", "score_correction_bias")


def param_dtype(path: tuple, var, dtype):
    """The dtype a parameter is placed in: the model's, except the parts of a quantized weight
    (their own, ``FORMATS``) and the ``FLOAT32_PARAMS`` the model made float32."""
    if path and path[-1] in FLOAT32_PARAMS and var.dtype == jnp.float32:
        return jnp.float32
    return var.dtype if len(path) > 1 and path[-1] in PARTS and path[-2] in QUANTIZABLE else dtype

