"""Checkpoints stored quantized (``quantization_config`` in config.json), read as they are stored.

Four formats: ``fp8`` (float8_e4m3fn weights with ``weight_scale_inv`` per tensor, per channel or
per block, as DeepSeek-V3 and the Qwen3 FP8 releases write them), ``compressed-tensors`` (what
llm-compressor writes: fp8, int8 and int4 weights, packed or not, symmetric or not, per tensor,
channel, group or block; read from the JSON and the tensors themselves, without the package),
``awq`` and ``gptq`` (int4 in int32 words, with zero points, groups of 128). Each quantized weight
``X`` ([out, in], Hugging Face layout) becomes a ``StoredWeight``: its values unpacked into one of
the engine's formats (``kernels.matmul.quantized.FORMATS``; int8 / int4 with float32 scales and
offsets, so every stored scale and every -scale * zero point is held exactly), its scales as
stored with the block of the weight each covers, and its zero points (``w = scale * (values - zero)``).
``StoredQuantizationSource`` presents them as the engine's quantized checkpoint tensors (``X``,
``X:scale``, ``X:offset``, ``models.quantization``), the scales repeated to the group the engine
keeps (a block's scale over each of its groups: exact), or, with ``dequantize``, as f32 weights.

What is not read: activation scales (``input_scale``, static activation schemes): the engine
computes with the weights dequantised inside the matmul and the activations as they are.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from jaxengine.kernels.matmul.quantized import FORMATS, dequantize_reference
from jaxengine.models.config import ModelConfig
from jaxengine.models.expert_tensors import common_name
from jaxengine.models.hf_tensors import Index, TensorSource
from jaxengine.models.quantization import grouped_sizes, kind_of, split_part

METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
KV_SCALE = re.compile(r"model\.layers\.\d+\.self_attn\.[kv]_scale")     # an FP8 KV cache's, per layer
_ONE_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight")


def stored_kind(name: str) -> str | None:
    """The kind of weight (``models.quantization``) a stored quantized weight is: one of a
    mixture's experts is of its stack's kind (``models.expert_tensors`` stacks the parts)."""
    m = _ONE_EXPERT.fullmatch(common_name(name))
    return f"experts.{m.group(1)}" if m else kind_of(name)


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """One quantized weight ``X`` of ``shape`` [out, in]: ``values()`` -> [out, in] in ``fmt``'s
    dtype (int4: uint8 0..15); ``scale()`` / ``zero()`` -> float32 [ceil(out / b0), ceil(in / b1)]
    for ``block`` (b0, b1); ``zero`` None: none. ``companions``: the checkpoint tensors it is read
    from besides ``X``."""
    name: str
    fmt: str
    shape: tuple[int, int]
    block: tuple[int, int]
    values: Callable[[], np.ndarray]
    scale: Callable[[], np.ndarray]
    zero: Callable[[], np.ndarray] | None
    companions: tuple[str, ...]

    def scale_at(self, group: int) -> np.ndarray:
        return self._per_group(self.scale(), group, "scale")

    def zero_at(self, group: int) -> np.ndarray:
        return self._per_group(self.zero(), group, "zero point")

    def _per_group(self, stored: np.ndarray, group: int, what: str) -> np.ndarray:
        """[out, in / group] from the stored per-block matrix (each block's value over its groups)."""
        (out, inner), (b0, b1) = self.shape, self.block
        want = (-(-out // b0), -(-inner // b1))
        stored = np.asarray(stored, np.float32).reshape(want) if stored.size == math.prod(want) else stored
        if stored.shape != want:
            raise ValueError(f"tensor {self.name}: its {what} has shape {tuple(stored.shape)}, {want} expected "
                             f"for a weight of {self.shape} in blocks of {self.block}")
        return stored[np.arange(out) // b0][:, (np.arange(inner // group) * group) // b1]


# ---------------------------------------------------------------- the plan and the source
def stored_plan(weights: Mapping[str, StoredWeight], cfg: ModelConfig, split: int = 1
                ) -> tuple[tuple[str, str, int, bool], ...]:
    """``ModelConfig.quantization`` for the stored weights: per kind, their format, the largest
    group that divides every weight's block and stays within a head (o_proj) and within a
    device's share of down_proj's grouped axis (split ``split`` ways), and an offset if any has
    a zero point. A kind some of whose weights are stored plain, or in two formats, is an error."""
    by_kind: dict[str, list[StoredWeight]] = {}
    for w in weights.values():
        if kind := stored_kind(w.name):
            by_kind.setdefault(kind, []).append(w)
    plan = []
    for kind, stored in sorted(by_kind.items()):
        if len(formats := {w.fmt for w in stored}) > 1:
            raise ValueError(f"{kind} weights stored in two formats ({sorted(formats)}): {stored[0].name}, ...")
        down = kind in ("down_proj", "experts.down_proj")
        sizes = {size // split if down else size for size in grouped_sizes(cfg, kind)}
        group = math.gcd(*(w.block[1] for w in stored), *(w.shape[1] for w in stored),
                         *(sizes if down or kind == "o_proj" else ()))
        plan.append((kind, formats.pop(), group, any(w.zero is not None for w in stored)))
    return tuple(plan)


class StoredQuantizationSource:
    """A checkpoint's tensors with its quantized weights presented as the engine's (``X``,
    ``X:scale``, ``X:offset``; as planned in ``cfg.quantization``; a mixture's experts one by one,
    stacked above by ``models.expert_tensors``), or dequantised to f32 under ``X`` (all with
    ``dequantize``); the tensors they are read from hidden."""

    def __init__(self, source: TensorSource, weights: Mapping[str, StoredWeight], cfg: ModelConfig,
                 dequantize: bool = False) -> None:
        self.source, self.weights, self.cfg = source, dict(weights), cfg
        self.hidden = {c for w in weights.values() for c in w.companions} | set(weights)
        self.plain = [name for name in source.names() if name not in self.hidden]
        self.kept = set() if dequantize else {name for name in weights if stored_kind(name)}
        for name in self.kept:
            if cfg.quant_spec(stored_kind(name)) is None:
                raise ValueError(f"tensor {name} is stored quantized where the model keeps its kind plain")

    def _spec(self, name: str) -> tuple[str, int, bool]:
        return self.cfg.quant_spec(stored_kind(name))

    def names(self) -> Iterable[str]:
        yield from self.plain
        for name in self.weights:
            yield name
            if name in self.kept:
                yield f"{name}:scale"
                if self._spec(name)[2]:
                    yield f"{name}:offset"

    def shape(self, name: str) -> tuple[int, ...]:
        base, part = split_part(name)
        if KV_SCALE.fullmatch(name):
            return (1,)                                  # stored as [] or [1]
        if base not in self.weights:
            return self.source.shape(name)
        out, inner = self.weights[base].shape
        return (out, inner // self._spec(base)[1]) if part else (out, inner)

    def describe(self, name: str) -> str:
        base, part = split_part(name)
        return f"{base} ({part or 'values'} as stored quantized)" if base in self.weights else name

    def read(self, name: str, index: Index) -> np.ndarray:
        base, part = split_part(name)
        w = self.weights.get(base)
        if KV_SCALE.fullmatch(name):
            return np.asarray(self.source.read(name, tuple(slice(None) for _ in self.source.shape(name))),
                              np.float32).reshape(1)[index]
        if w is None:
            return self.source.read(name, index)
        if base not in self.kept:
            group = math.gcd(w.shape[1], w.block[1])
            zero = None if w.zero is None else -w.scale_at(group) * w.zero_at(group)
            return dequantize_reference(w.values(), w.scale_at(group), zero)[index]
        fmt, group, offset = self._spec(base)
        if part == "scale":
            return w.scale_at(group).astype(FORMATS[fmt].scale)[index]
        if part == "offset":
            zero = np.zeros(self.shape(name), np.float32) if w.zero is None else w.zero_at(group)
            return (-w.scale_at(group) * zero).astype(FORMATS[fmt].scale)[index]
        return w.values()[index]


# ---------------------------------------------------------------- the formats
def stored_weights(source: TensorSource, quant: Mapping) -> dict[str, StoredWeight]:
    """The quantized weights of a checkpoint whose ``quantization_config`` is ``quant``; an
    unsupported scheme is an error naming the field, its value and what is supported."""
    method = quant.get("quant_method")
    readers = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        _unsupported("quant_method", method, METHODS)
    names = set(source.names())
    return readers[method](source, names, quant)


def _unsupported(field: str, value, supported) -> None:
    raise ValueError(f"quantization_config.{field}: {value!r} is not supported (supported: {list(supported)})")


_EXPERT = re.compile(r".*\.experts\.\d+\.(gate|up|down)_proj")


def _linear_modules(names: set[str], suffix: str, any_kind: bool = False) -> list[str]:
    """Modules (``model.layers.0.mlp.up_proj``) of the kinds the engine keeps quantized, a mixture's
    experts one by one among them, that have a tensor ``<module>.<suffix>``; with ``any_kind``
    every module with a ``.weight`` beside it (those of other kinds are read dequantised:
    DeepSeek-V3's latent projections)."""
    modules = (n[:-len(suffix) - 1] for n in names if n.endswith("." + suffix))
    return sorted(m for m in modules if kind_of(m + ".weight") or _EXPERT.fullmatch(common_name(m + ".")[:-1])
                  or (any_kind and f"{m}.weight" in names))


def _fp8(source: TensorSource, names: set[str], quant: Mapping) -> dict[str, StoredWeight]:
    if (scheme := quant.get("activation_scheme", "dynamic")) not in ("dynamic", "static"):
        _unsupported("activation_scheme", scheme, ("dynamic", "static"))
    if (fmt := quant.get("fmt", "e4m3")) != "e4m3":
        _unsupported("fmt", fmt, ("e4m3",))
    block = quant.get("weight_block_size")
    weights = {}
    for suffix in ("weight_scale_inv", "weight_scale"):
        for module in _linear_modules(names, suffix, any_kind=True):
            x, s = f"{module}.weight", f"{module}.{suffix}"
            shape = tuple(source.shape(x))
            stored = tuple(source.shape(s))
            if block:
                blocking = tuple(block)
            elif math.prod(stored) == 1:
                blocking = shape                                    # one scale for the tensor
            elif math.prod(stored) == shape[0]:
                blocking = (1, shape[1])                            # one per output channel
            else:
                raise ValueError(f"tensor {s}: shape {stored} is neither one scale, one per output channel "
                                 f"({shape[0]}) nor blocks (quantization_config.weight_block_size is unset)")
            weights[x] = StoredWeight(x, "fp8", shape, blocking, _float8(source, x),
                                      _whole(source, s), None, (s, f"{module}.input_scale"))
    return weights


def _compressed_tensors(source: TensorSource, names: set[str], quant: Mapping) -> dict[str, StoredWeight]:
    groups = quant.get("config_groups") or {}
    ignore = list(quant.get("ignore") or [])
    weights = {}
    for module in _linear_modules(names, "weight_scale"):
        if _targeted(module, ignore):
            continue
        key, scheme = next(((k, g) for k, g in groups.items() if _targeted(module, g.get("targets") or [])),
                           (None, None))
        if scheme is None:
            raise ValueError(f"tensor {module}.weight_scale: no quantization_config.config_groups entry targets {module}")
        args = scheme.get("weights") or {}
        fmt_name = scheme.get("format") or quant.get("format")
        field = f"config_groups.{key}.weights"
        bits, kind = args.get("num_bits"), args.get("type", "int")
        if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
            _unsupported(f"{field}.type/num_bits", f"{kind}/{bits}", ["int/4", "int/8", "float/8"])
        if fmt_name not in ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized"):
            _unsupported("format", fmt_name, ["pack-quantized", "int-quantized", "naive-quantized", "float-quantized"])
        if args.get("actorder") and f"{module}.weight_g_idx" in names:
            _unsupported(f"{field}.actorder", args["actorder"], [None])
        x = f"{module}.weight"
        packed = f"{module}.weight_packed"
        shape = (tuple(int(v) for v in source.read(f"{module}.weight_shape", (slice(None),)))
                 if packed in names else tuple(source.shape(x)))
        blocking = _ct_block(args, shape, field)
        zp = f"{module}.weight_zero_point"
        signed_shift = 8 if bits == 4 else 0          # int4 held as 0..15: q + 8
        if kind == "float":
            values = _float8(source, x)
        elif packed in names:
            values = _packed_ints(source, packed, bits, shape, shift=signed_shift - (1 << (bits - 1)),
                                  dtype=FORMATS[f"int{bits}"].values)
        else:
            values = _ints(source, x, shift=signed_shift)
        zero = None
        if not args.get("symmetric", True):
            zshape = (-(-shape[0] // blocking[0]), -(-shape[1] // blocking[1]))
            stored_zero = (_packed_ints(source, zp, bits, zshape, shift=-(1 << (bits - 1)), axis=0)
                           if packed in names else _ints(source, zp, shift=0))
            zero = (lambda z=stored_zero: z().astype(np.float32) + signed_shift)
        elif bits == 4:
            zero = (lambda: np.float32([[signed_shift]]))
        weights[x] = StoredWeight(x, "fp8" if kind == "float" else f"int{bits}-f32", shape, blocking, values,
                                  _whole(source, f"{module}.weight_scale"), _broadcast(zero, shape, blocking),
                                  (packed, f"{module}.weight_shape", f"{module}.weight_scale", zp,
                                   f"{module}.weight_g_idx", f"{module}.input_scale"))
    return weights


def _targeted(module: str, targets: list[str]) -> bool:
    """compressed-tensors' targets: ``re:<pattern>`` on the module name, a module name, or a
    module class (every projection the engine quantizes is a ``Linear``)."""
    for target in targets:
        if target.startswith("re:"):
            if re.match(target[3:], module):
                return True
        elif target in ("Linear", module) or module.endswith("." + target):
            return True
    return False


def _ct_block(args: Mapping, shape: tuple[int, int], field: str) -> tuple[int, int]:
    strategy = args.get("strategy", "tensor")
    if strategy == "tensor":
        return shape
    if strategy == "channel":
        return (1, shape[1])
    if strategy == "group":
        return (1, int(args["group_size"]))
    if strategy == "block":
        return tuple(int(b) for b in args["block_structure"])
    _unsupported(f"{field}.strategy", strategy, ["tensor", "channel", "group", "block"])


def _awq(source: TensorSource, names: set[str], quant: Mapping) -> dict[str, StoredWeight]:
    if (bits := quant.get("bits", quant.get("w_bit"))) != 4:
        _unsupported("bits", bits, [4])
    if (version := str(quant.get("version", "gemm")).lower()) != "gemm":
        _unsupported("version", version, ["gemm"])
    if not quant.get("zero_point", True):
        _unsupported("zero_point", False, [True])
    weights = {}
    for module in _linear_modules(names, "qweight"):
        qweight, qzeros, scales = (f"{module}.{t}" for t in ("qweight", "qzeros", "scales"))
        inner, words = source.shape(qweight)
        groups, out = source.shape(scales)
        shape = (out, inner)
        # AWQ's word holds 8 output columns in the order 0 2 4 6 1 3 5 7 (nibble i: column ORDER[i])
        values = _packed_ints(source, qweight, 4, (inner, out), shift=0, order=_AWQ_ORDER, transpose=True,
                              dtype=np.uint8)
        zeros = _packed_ints(source, qzeros, 4, (groups, out), shift=0, order=_AWQ_ORDER, transpose=True)
        weights[f"{module}.weight"] = StoredWeight(
            f"{module}.weight", "int4-f32", shape, (1, inner // groups), values, _transposed(_whole(source, scales)),
            lambda z=zeros: z().astype(np.float32), (qweight, qzeros, scales))
    return weights


_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _gptq(source: TensorSource, names: set[str], quant: Mapping) -> dict[str, StoredWeight]:
    if (bits := quant.get("bits")) not in (4, 8):
        _unsupported("bits", bits, [4, 8])
    if (form := quant.get("checkpoint_format", "gptq")) not in ("gptq", "gptq_v2"):
        _unsupported("checkpoint_format", form, ["gptq", "gptq_v2"])
    weights = {}
    for module in _linear_modules(names, "qweight"):
        qweight, qzeros, scales, g_idx = (f"{module}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx"))
        groups, out = source.shape(scales)
        inner = source.shape(qweight)[0] * 32 // bits
        if g_idx in names:
            order = np.asarray(source.read(g_idx, (slice(None),)))
            if not np.array_equal(order, np.arange(inner) // (inner // groups)):
                raise ValueError(f"tensor {g_idx}: the input channels are reordered (desc_act); "
                                 "quantization_config.desc_act: True is not supported (supported: [False])")
        # values 0..2^bits - 1; int8 is signed: held as value - 128, the zero point shifted alike
        shift = 0 if bits == 4 else -128
        values = _packed_ints(source, qweight, bits, (inner, out), shift=shift, axis=0, transpose=True,
                              dtype=FORMATS[f"int{bits}"].values)
        zeros = _packed_ints(source, qzeros, bits, (groups, out), shift=0, transpose=True)
        # gptq (v1) stores each zero point less one
        first = (1 if form == "gptq" else 0) + shift
        weights[f"{module}.weight"] = StoredWeight(
            f"{module}.weight", f"int{bits}-f32", (out, inner), (1, inner // groups), values,
            _transposed(_whole(source, scales)), lambda z=zeros, d=first: z().astype(np.float32) + d,
            (qweight, qzeros, scales, g_idx, f"{module}.bias") if _zero_bias(source, names, module)
            else (qweight, qzeros, scales, g_idx))
    return weights


def _zero_bias(source: TensorSource, names: set[str], module: str) -> bool:
    """GPTQ writers keep an all-zero bias for projections that have none: hidden then."""
    bias = f"{module}.bias"
    return bias in names and not np.any(np.asarray(source.read(bias, (slice(None),)), np.float32))


# ---------------------------------------------------------------- readers of stored tensors
def _whole(source: TensorSource, name: str) -> Callable[[], np.ndarray]:
    return lambda: np.asarray(source.read(name, tuple(slice(None) for _ in source.shape(name))), np.float32)


def _transposed(read: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: read().T


def _broadcast(zero, shape, block):
    """A constant zero point (one value) as the per-block matrix."""
    if zero is None:
        return None
    want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    return lambda: np.broadcast_to(zero(), want) if zero().size == 1 else zero()


def _float8(source: TensorSource, name: str) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        values = np.asarray(source.read(name, tuple(slice(None) for _ in source.shape(name))))
        if values.dtype != FORMATS["fp8"].values:
            raise ValueError(f"tensor {name}: dtype {values.dtype}, float8_e4m3fn expected")
        return values
    return read


def _ints(source: TensorSource, name: str, shift: int) -> Callable[[], np.ndarray]:
    """int8 values as stored (+ ``shift``: int4 held as 0..15)."""
    def read() -> np.ndarray:
        values = np.asarray(source.read(name, tuple(slice(None) for _ in source.shape(name))))
        if values.dtype != np.int8:
            raise ValueError(f"tensor {name}: dtype {values.dtype}, int8 expected")
        return (values.astype(np.int16) + shift).astype(np.uint8 if shift else np.int8)
    return read


def _packed_ints(source: TensorSource, name: str, bits: int, shape: tuple[int, int], shift: int, axis: int = 1,
                 order: tuple[int, ...] | None = None, transpose: bool = False,
                 dtype=np.int16) -> Callable[[], np.ndarray]:
    """Unsigned ``bits``-bit values packed in int32 words along ``axis`` (value i of a word at
    bits ``bits * i``; with ``order``, value i is element ``order[i]`` of the word's run), plus
    ``shift``, as [rows, cols] ``shape`` (before ``transpose``) in ``dtype``."""
    per_word = 32 // bits

    def read() -> np.ndarray:
        words = np.asarray(source.read(name, tuple(slice(None) for _ in source.shape(name))))
        if words.dtype != np.int32:
            raise ValueError(f"tensor {name}: dtype {words.dtype}, int32 expected")
        words = np.moveaxis(words.view(np.uint32), axis, -1)
        nibbles = (words[..., None] >> (bits * np.arange(per_word, dtype=np.uint32))) & ((1 << bits) - 1)
        if order is not None:
            nibbles = nibbles[..., np.argsort(order)]
        flat = nibbles.reshape(*words.shape[:-1], -1)
        length = shape[axis]
        if flat.shape[-1] < length:
            raise ValueError(f"tensor {name}: {flat.shape[-1]} values along axis {axis}, {length} expected")
        values = np.moveaxis(flat[..., :length], -1, axis)
        if values.shape != tuple(shape):
            raise ValueError(f"tensor {name}: holds {values.shape} values, {tuple(shape)} expected")
        out = (values.astype(np.int16) + shift).astype(dtype)
        return out.T if transpose else out
    return read

