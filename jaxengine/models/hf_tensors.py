"""Hugging Face-named tensors -> our parameters.

Every checkpoint reader gives tensors under Hugging Face names in Hugging Face layout ([out, in]),
read a slice at a time through a ``TensorSource``. A layout per tensor turns those into the
model's einsum layout, and a slice of one of our parameters reads only the part of each HF tensor
it comes from, so a loader can place one device's slice at a time.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from jaxengine.kernels.matmul.quantized import FORMATS, pack_int4
from jaxengine.models.config import ModelConfig

ParamPath = tuple
Index = tuple[slice, ...]          # step-1 slices with bounds, one per dimension


# ---------------------------------------------------------------- tensor sources
@runtime_checkable
class TensorSource(Protocol):
    """HF-named tensors, read a slice at a time."""

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, index: Index) -> np.ndarray: ...


class ArraySource:
    """Tensors already in memory (a dequantised GGUF, a test's dict)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self.tensors = tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self.tensors[name]))

    def read(self, name: str, index: Index) -> np.ndarray:
        return np.asarray(self.tensors[name])[index]


# ---------------------------------------------------------------- layouts: HF [out, in] -> ours
# Each layout maps a slice of our per-layer tensor to the part of the HF tensor it comes from
# (``read`` gets that part through ``read_hf(hf_index)``), and our shape to HF's for the checks.
class Same:
    """Ours is HF's: embedding [V, D], norms."""

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(shape)

    def read(self, read_hf: Callable[[Index], np.ndarray], index: Index) -> np.ndarray:
        return read_hf(index)


class Transposed:
    """HF's [out, in] transposed: gate/up [D, F], down [F, D], lm_head [D, V]."""

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(reversed(shape))

    def read(self, read_hf, index: Index) -> np.ndarray:
        return read_hf(index[::-1]).T


class ExpertsTransposed:
    """Each expert's HF [out, in] transposed: experts' gate/up [E, D, F] from [E, F, D], down [E, F, D]
    from [E, D, F] (``models.expert_tensors`` shows every checkpoint's experts so)."""

    def hf_shape(self, shape: tuple) -> tuple:
        e, a, b = shape
        return (e, b, a)

    def read(self, read_hf, index: Index) -> np.ndarray:
        e, a, b = index
        return read_hf((e, b, a)).transpose(0, 2, 1)


def _head_rows(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


@dataclasses.dataclass(frozen=True)
class HeadsIn:
    """q/k/v [D, n, H] from HF [n*H, D]: a range of heads is a block of HF rows."""
    head_dim: int

    def hf_shape(self, shape: tuple) -> tuple:
        d, n, h = shape
        return (n * h, d)

    def read(self, read_hf, index: Index) -> np.ndarray:
        d, heads, h = index
        w = read_hf((_head_rows(heads, self.head_dim), d)).T
        return w.reshape(w.shape[0], -1, self.head_dim)[:, :, h]


@dataclasses.dataclass(frozen=True)
class HeadsOut:
    """o_proj [N, H, D] from HF [D, N*H]: a range of heads is a block of HF columns."""
    head_dim: int

    def hf_shape(self, shape: tuple) -> tuple:
        n, h, d = shape
        return (d, n * h)

    def read(self, read_hf, index: Index) -> np.ndarray:
        heads, h, d = index
        w = read_hf((d, _head_rows(heads, self.head_dim))).T
        return w.reshape(-1, self.head_dim, w.shape[1])[:, h, :]


@dataclasses.dataclass(frozen=True)
class HeadsBias:
    """q/k/v biases [n, H] from HF [n*H]."""
    head_dim: int

    def hf_shape(self, shape: tuple) -> tuple:
        n, h = shape
        return (n * h,)

    def read(self, read_hf, index: Index) -> np.ndarray:
        heads, h = index
        return read_hf((_head_rows(heads, self.head_dim),)).reshape(-1, self.head_dim)[:, h]


class ConvTaps:
    """A depthwise convolution's taps [K, C] (oldest first) from HF's Conv1d weight [C, 1, K]."""

    def hf_shape(self, shape: tuple) -> tuple:
        k, c = shape
        return (c, 1, k)

    def read(self, read_hf, index: Index) -> np.ndarray:
        taps, channels = index
        return read_hf((channels, slice(0, 1), taps))[:, 0, :].T


@dataclasses.dataclass(frozen=True)
class RotaryDeinterleaved:
    """DeepSeek's rotary dimensions stored in pairs (x0, x1), (x2, x3)...: the ``size`` of them
    from ``start`` on the last axis read as evens then odds, the half-split layout ``apply_rope``
    rotates. Queries and keys are permuted alike, so their products are unchanged."""
    inner: object
    start: int
    size: int

    def hf_shape(self, shape: tuple) -> tuple:
        return self.inner.hf_shape(shape)

    def read(self, read_hf, index: Index) -> np.ndarray:
        w = self.inner.read(read_hf, index)
        last = index[-1]
        if (last.start, last.stop) != (0, w.shape[-1]) or w.shape[-1] < self.start + self.size:
            raise ValueError("a rotary projection is read whole along its last axis")
        rotary = np.arange(self.start, self.start + self.size)
        order = np.concatenate([np.arange(self.start), rotary[0::2], rotary[1::2],
                                np.arange(self.start + self.size, w.shape[-1])])
        return w[..., order]


@dataclasses.dataclass(frozen=True)
class RepeatedHeads:
    """KV heads repeated ``repeats`` times in a row (head j -> j*r .. j*r + r - 1) on ``axis``:
    heads [a, b) of ours are copies of original heads a//r .. (b-1)//r, each read once."""
    inner: object
    axis: int
    repeats: int

    def hf_shape(self, shape: tuple) -> tuple:
        original = list(shape)
        original[self.axis] //= self.repeats
        return self.inner.hf_shape(tuple(original))

    def read(self, read_hf, index: Index) -> np.ndarray:
        r, axis = self.repeats, self.axis
        a, b = index[axis].start, index[axis].stop
        first = a // r
        original = (*index[:axis], slice(first, (b - 1) // r + 1), *index[axis + 1:])
        w = np.repeat(self.inner.read(read_hf, original), r, axis=axis)
        return w[(slice(None),) * axis + (slice(a - first * r, b - first * r),)]


@dataclasses.dataclass(frozen=True)
class Packed:
    """int4 values packed two a byte along ``axis`` of ours (``kernels.matmul.quantized``): rows
    [a, b) of ours are rows [2a, 2b) of the unpacked values ``inner`` reads."""
    inner: object
    axis: int

    def hf_shape(self, shape: tuple) -> tuple:
        unpacked = list(shape)
        unpacked[self.axis] *= 2
        return self.inner.hf_shape(tuple(unpacked))

    def read(self, read_hf, index: Index) -> np.ndarray:
        a = index[self.axis]
        unpacked = (*index[:self.axis], slice(2 * a.start, 2 * a.stop), *index[self.axis + 1:])
        return pack_int4(self.inner.read(read_hf, unpacked), self.axis)


# Kinds of weight that can be kept quantized -> how many trailing axes of our per-layer parameter
# are the matmul's output (the grouped axis is the one before them). A mixture of experts' routed
# experts are kinds of their own ([E, D, F] and [E, F, D]: the expert axis leads).
QUANTIZABLE = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 1, "gate_proj": 1, "up_proj": 1,
               "down_proj": 1, "embed_tokens": 1, "lm_head": 1,
               "experts.gate_proj": 1, "experts.up_proj": 1, "experts.down_proj": 1}
EXPERT_KINDS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


def kind_at(path: ParamPath) -> str:
    """The kind of weight (``QUANTIZABLE``'s names) of the parameter at ``path`` (its last name,
    or ``experts.<name>`` for a mixture's routed experts)."""
    return f"experts.{path[-1]}" if len(path) > 1 and path[-2] == "experts" else path[-1]


def quantized_layout(layout, path: ParamPath, part: str, cfg: ModelConfig):
    """The layout of part ``part`` (``q``, ``scale``, ``offset``) of the quantized weight at
    ``path``, from the plain weight's: the embedding transposed ([D, V], models.quantization),
    o_proj's scales by groups of its heads' columns, int4 values packed along the grouped axis."""
    kind = kind_at(path)
    fmt, group, _ = cfg.quant_spec(kind)
    if kind == "embed_tokens":
        layout = Transposed()
    if part != "q" and isinstance(layout, HeadsOut):
        return HeadsOut(layout.head_dim // group)
    if part == "q" and FORMATS[fmt].bits == 4:
        ndim = 3 if kind in ("q_proj", "k_proj", "v_proj", "o_proj", *EXPERT_KINDS) else 2
        return Packed(layout, ndim - 1 - QUANTIZABLE[kind])
    return layout


# Hugging Face name -> (our path, layout). The layer index is the pattern's first group.
_LAYER = r"model\.layers\.(\d+)\."


def _rules(cfg: ModelConfig) -> list[tuple[re.Pattern, Callable[[re.Match], ParamPath], object]]:
    h = cfg.head_dim

    def layer(*rest):
        return lambda m: ("layers", int(m.group(1)), *rest)

    if cfg.is_mla:
        return _latent_attention_rules(cfg, layer) + _common_rules(cfg, layer)
    return [
        # (with an output gate each head's rows are its query's, then its gate's)
        (re.compile(_LAYER + r"self_attn\.q_proj\.weight"), layer("self_attn", "q_proj"),
         HeadsIn(2 * h if cfg.attention_output_gate else h)),
        (re.compile(_LAYER + r"self_attn\.o_proj\.weight"), layer("self_attn", "o_proj"), HeadsOut(h)),
    ] + _common_rules(cfg, layer)


def _latent_attention_rules(cfg: ModelConfig, layer) -> list:
    """DeepSeek-V3's attention tensors (``models.latent_attention``'s names)."""
    q_head, r, hr = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.head_dim

    def rotary(layout, start):
        return RotaryDeinterleaved(layout, start, hr) if cfg.rope_interleave else layout

    return [
        (re.compile(_LAYER + r"self_attn\.q_proj\.weight"), layer("self_attn", "q_proj"),
         rotary(HeadsIn(q_head), cfg.qk_nope_head_dim)),
        (re.compile(_LAYER + r"self_attn\.q_b_proj\.weight"), layer("self_attn", "q_b_proj"),
         rotary(HeadsIn(q_head), cfg.qk_nope_head_dim)),
        (re.compile(_LAYER + r"self_attn\.q_a_proj\.weight"), layer("self_attn", "q_a_proj"), Transposed()),
        (re.compile(_LAYER + r"self_attn\.q_a_layernorm\.weight"), layer("self_attn", "q_a_norm", "weight"), Same()),
        (re.compile(_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight"), layer("self_attn", "kv_a_proj"),
         rotary(Transposed(), r)),
        (re.compile(_LAYER + r"self_attn\.kv_a_layernorm\.weight"), layer("self_attn", "kv_a_norm", "weight"), Same()),
        (re.compile(_LAYER + r"self_attn\.kv_b_proj\.weight"), layer("self_attn", "kv_b_proj"),
         HeadsIn(cfg.qk_nope_head_dim + cfg.v_head_dim)),
        (re.compile(_LAYER + r"self_attn\.o_proj\.weight"), layer("self_attn", "o_proj"), HeadsOut(cfg.v_head_dim)),
        # a multi-token prediction layer's own (models.mtp, which shows it as layer 0)
        (re.compile(_LAYER + r"(enorm|hnorm)\.weight"), lambda m: (m.group(2), "weight"), Same()),
        (re.compile(_LAYER + r"eh_proj\.weight"), lambda m: ("eh_proj",), Transposed()),
        (re.compile(_LAYER + r"shared_head\.norm\.weight"), lambda m: ("shared_head_norm", "weight"), Same()),
    ]


def _common_rules(cfg: ModelConfig, layer) -> list:
    h = cfg.head_dim
    return [
        (re.compile(r"model\.embed_tokens\.weight"), lambda m: ("embed_tokens",), Same()),
        (re.compile(r"model\.norm\.weight"), lambda m: ("norm", "weight"), Same()),
        (re.compile(r"lm_head\.weight"), lambda m: ("lm_head",), Transposed()),
        (re.compile(_LAYER + r"self_attn\.k_proj\.weight"), layer("self_attn", "k_proj"), HeadsIn(h)),
        (re.compile(_LAYER + r"self_attn\.v_proj\.weight"), layer("self_attn", "v_proj"), HeadsIn(h)),
        (re.compile(_LAYER + r"self_attn\.q_proj\.bias"), layer("self_attn", "q_bias"), HeadsBias(h)),
        (re.compile(_LAYER + r"self_attn\.k_proj\.bias"), layer("self_attn", "k_bias"), HeadsBias(h)),
        (re.compile(_LAYER + r"self_attn\.v_proj\.bias"), layer("self_attn", "v_bias"), HeadsBias(h)),
        (re.compile(_LAYER + r"self_attn\.o_proj\.bias"), layer("self_attn", "o_bias"), Same()),
        (re.compile(_LAYER + r"self_attn\.sinks"), layer("self_attn", "sinks"), Same()),
        (re.compile(_LAYER + r"self_attn\.k_scale"), layer("self_attn", "k_scale"), Same()),
        (re.compile(_LAYER + r"self_attn\.v_scale"), layer("self_attn", "v_scale"), Same()),
        (re.compile(_LAYER + r"self_attn\.q_norm\.weight"), layer("self_attn", "q_norm", "weight"), Same()),
        (re.compile(_LAYER + r"self_attn\.k_norm\.weight"), layer("self_attn", "k_norm", "weight"), Same()),
        (re.compile(_LAYER + r"mlp\.gate_proj\.weight"), layer("mlp", "gate_proj"), Transposed()),
        (re.compile(_LAYER + r"mlp\.up_proj\.weight"), layer("mlp", "up_proj"), Transposed()),
        (re.compile(_LAYER + r"mlp\.down_proj\.weight"), layer("mlp", "down_proj"), Transposed()),
        (re.compile(_LAYER + r"mlp\.gate\.weight"), layer("mlp", "router"), Transposed()),
        (re.compile(_LAYER + r"mlp\.router\.weight"), layer("mlp", "router"), Transposed()),      # gpt-oss
        (re.compile(_LAYER + r"mlp\.router\.bias"), layer("mlp", "router_bias"), Same()),
        (re.compile(_LAYER + r"mlp\.experts\.(gate|up|down)_proj_bias"),
         lambda m: ("layers", int(m.group(1)), "mlp", "experts", f"{m.group(2)}_bias"), Same()),
        (re.compile(_LAYER + r"mlp\.experts\.(gate_proj|up_proj|down_proj)"),
         lambda m: ("layers", int(m.group(1)), "mlp", "experts", m.group(2)), ExpertsTransposed()),
        (re.compile(_LAYER + r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight"),
         lambda m: ("layers", int(m.group(1)), "mlp", "shared_expert", m.group(2)), Transposed()),
        (re.compile(_LAYER + r"mlp\.shared_expert_gate\.weight"), layer("mlp", "shared_expert_gate"), Transposed()),
        (re.compile(_LAYER + r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight"),
         lambda m: ("layers", int(m.group(1)), "mlp", "shared_expert", m.group(2)), Transposed()),
        (re.compile(_LAYER + r"mlp\.gate\.e_score_correction_bias"), layer("mlp", "score_correction_bias"), Same()),
        (re.compile(_LAYER + r"mlp\.fc1_latent_proj\.weight"), layer("mlp", "latent_in"), Transposed()),
        (re.compile(_LAYER + r"mlp\.fc2_latent_proj\.weight"), layer("mlp", "latent_out"), Transposed()),
        # recurrent layers: Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2
        (re.compile(_LAYER + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|in_proj|out_proj)\.weight"),
         lambda m: ("layers", int(m.group(1)), "linear_attn", m.group(2)), Transposed()),
        (re.compile(_LAYER + r"linear_attn\.(in_proj|out_proj)\.bias"),
         lambda m: ("layers", int(m.group(1)), "linear_attn", m.group(2)[:-5] + "_bias"), Same()),
        (re.compile(_LAYER + r"linear_attn\.conv1d\.weight"), layer("linear_attn", "conv_weight"), ConvTaps()),
        (re.compile(_LAYER + r"linear_attn\.conv1d\.bias"), layer("linear_attn", "conv_bias"), Same()),
        (re.compile(_LAYER + r"linear_attn\.(dt_bias|A_log|D)"),
         lambda m: ("layers", int(m.group(1)), "linear_attn", m.group(2)), Same()),
        (re.compile(_LAYER + r"linear_attn\.norm\.weight"), layer("linear_attn", "norm_weight"), Same()),
        (re.compile(_LAYER + r"input_layernorm\.weight"), layer("input_layernorm", "weight"), Same()),
        (re.compile(_LAYER + r"post_attention_layernorm\.weight"), layer("post_attention_layernorm", "weight"), Same()),
    ]


# Nemotron-H's checkpoints (NVIDIA's names, which transformers writes back): the model under
# ``backbone.``, and each block's one part under ``mixer.``, named here by its kind.
NEMOTRON_ARCHITECTURES = ("NemotronHForCausalLM",)
_NEMOTRON_NAMES = [(re.compile(r"^backbone\."), "model."), (re.compile(r"^model\.embeddings\."), "model.embed_tokens."),
                   (re.compile(r"^model\.norm_f\."), "model.norm."),
                   (re.compile(r"\.mixer\.(q_proj|k_proj|v_proj|o_proj)\."), r".self_attn.\1."),
                   (re.compile(r"\.mixer\.(up_proj|down_proj|experts|gate|shared_experts|fc1_latent_proj|"
                               r"fc2_latent_proj)\."), r".mlp.\1."),
                   (re.compile(r"\.mixer\."), ".linear_attn."),
                   (re.compile(r"^(model\.layers\.\d+)\.norm\."), r"\1.input_layernorm.")]


def nemotron_name(name: str) -> str:
    """A Nemotron-H checkpoint's tensor name in the common naming."""
    for pattern, replacement in _NEMOTRON_NAMES:
        name = pattern.sub(replacement, name)
    return name


_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# A hybrid model's multi-token prediction layers (transformers leaves them unread too)
_IGNORED_HYBRID = re.compile(r"mtp\..*")
# A vision-language checkpoint read as its language model (``ModelConfig.language_model_of``)
_LANGUAGE_MODEL = re.compile(r"model\.language_model\.")
_VISION = re.compile(r"model\.visual\..*")
_LAYER_INDEX = re.compile(_LAYER)
KV_HEAD_AXIS = {"k_proj": 1, "v_proj": 1, "k_bias": 0, "v_bias": 0}      # in our per-layer layout

Located = dict[ParamPath, tuple[str, object]]      # our per-layer path -> (HF name, layout)


def locate_tensors(source: TensorSource, cfg: ModelConfig, kv_repeats: int = 1) -> tuple[Located, list[str]]:
    """Where each of our per-layer parameters comes from, plus the HF names nothing maps."""
    rules = _rules(cfg)
    located, unexpected = {}, []
    names = set(source.names())
    for name in names:
        base, _, part = name.partition(":")           # a quantized tensor's scale and offset: X:scale
        stored = base
        if cfg.language_model_of is not None:
            if _VISION.fullmatch(base):
                continue
            base = _LANGUAGE_MODEL.sub("model.", base, count=1)
        if cfg.architecture in NEMOTRON_ARCHITECTURES:
            base = nemotron_name(base)
        if _IGNORED.match(base) or (base == "lm_head.weight" and cfg.tie_word_embeddings) or \
                (cfg.is_hybrid and _IGNORED_HYBRID.fullmatch(base)):
            continue
        if cfg.num_mtp_layers and (m := _LAYER_INDEX.match(base)) and int(m.group(1)) >= cfg.num_layers:
            continue          # a multi-token prediction layer: not the decoder's

        match = next(((m, path, layout) for pattern, path, layout in rules if (m := pattern.fullmatch(base))), None)
        if match is None:
            unexpected.append(name)
            continue
        m, path, layout = match
        p = path(m)
        axis = KV_HEAD_AXIS.get(p[-1]) if p[0] == "layers" else None
        if part or f"{stored}:scale" in names:
            if cfg.quant_spec(kind_at(p)) is None:     # quantized, where the model keeps it plain
                unexpected.append(name)
                continue
            part = part or "q"
            layout, p = quantized_layout(layout, p, part, cfg), (*p, part)
        if kv_repeats > 1 and axis is not None:
            layout = RepeatedHeads(layout, axis, kv_repeats)
        located[p] = (name, layout)
    return located, unexpected


def check_tensors(located: Located, unexpected: list[str], source: TensorSource, flat, cfg: ModelConfig) -> None:
    """ValueError naming every missing, unexpected and misshapen tensor."""
    expected = {q for p, _ in flat for q in _per_layer(p, cfg)}
    missing = [_path_name(p) for p in sorted(expected - located.keys(), key=str)]
    unexpected = unexpected + [_path_name(p) for p in located.keys() - expected]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cfg.architecture}: missing tensors {sorted(missing)}; "
                         f"unexpected tensors {sorted(unexpected)}")
    for path, var in flat:
        per_layer_shape = tuple(var.shape[1:]) if path[0] in _STACKS else tuple(var.shape)
        for p in _per_layer(path, cfg):
            name, layout = located[p]
            if source.shape(name) != (want := layout.hf_shape(per_layer_shape)):
                described = source.describe(name) if hasattr(source, "describe") else name
                raise ValueError(f"tensor {described}: shape {source.shape(name)} in the checkpoint, "
                                 f"{want} expected")


def read_param(source: TensorSource, located: Located, path: ParamPath, index: Index, dtype,
               cfg: ModelConfig) -> np.ndarray:
    """The slice ``index`` of parameter ``path`` (our stacked layout, [L, ...] for layers), read
    from its HF tensors as ``dtype``. Layers are written one at a time into the result, so the
    host holds the slice plus one layer's part in flight."""
    if path[0] not in _STACKS:
        name, layout = located[path]
        return np.ascontiguousarray(layout.read(functools.partial(source.read, name), index), dtype)
    layers = _per_layer(path, cfg)[index[0]]
    out = np.empty([len(layers)] + [s.stop - s.start for s in index[1:]], dtype)
    for i, layer in enumerate(layers):
        name, layout = located[layer]
        out[i] = layout.read(functools.partial(source.read, name), index[1:])
    return out


# The stacked parameters: 'layers' holds every layer; with dense layers among sparse ones, the
# MLPs are in a stack per kind ('sparse_mlp', 'dense_mlp'), each holding some layers' 'mlp'; a
# hybrid model's token mixers are in a stack per kind ('attention_layers', 'linear_layers').
_STACKS = {"layers": (lambda cfg: range(cfg.num_layers), ()),
           "sparse_mlp": (lambda cfg: cfg.sparse_layers, ("mlp",)),
           "dense_mlp": (lambda cfg: cfg.dense_layers, ("mlp",)),
           "attention_layers": (lambda cfg: cfg.kv_layers, ("self_attn",)),
           "linear_layers": (lambda cfg: cfg.linear_attention_layers, ("linear_attn",))}


def _per_layer(path: ParamPath, cfg: ModelConfig) -> list[ParamPath]:
    """A stacked parameter stands for one per-layer parameter ('layers', i, ...) of each of its layers."""
    if path[0] not in _STACKS:
        return [path]
    layers, prefix = _STACKS[path[0]]
    return [("layers", i, *prefix, *path[1:]) for i in layers(cfg)]


def _path_name(path: ParamPath) -> str:
    return ".".join(str(p) for p in path)
