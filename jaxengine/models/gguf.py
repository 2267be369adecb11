"""GGUF files: read and dequantised into HF-named tensors (with the ``gguf`` package), and loaded
through the converted-weights cache, so a file is dequantised once, not at every start."""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxengine.kernels.matmul.quantized import FORMATS
from jaxengine.models.config import ModelConfig, YarnScaling
from jaxengine.paths import CheckpointFileError, converted_cache_path
from jaxengine.models.quantization import kind_of
from jaxengine.models.weight_cache import cached_config, restore_converted, save_converted

_GGUF_NAMES = [
    (re.compile(r"token_embd\.weight"), "model.embed_tokens.weight"),
    (re.compile(r"output_norm\.weight"), "model.norm.weight"),
    (re.compile(r"output\.weight"), "lm_head.weight"),
    (re.compile(r"blk\.(\d+)\.attn_norm\.weight"), "model.layers.{}.input_layernorm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_norm\.weight"), "model.layers.{}.post_attention_layernorm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_q\.(weight|bias)"), "model.layers.{}.self_attn.q_proj.{}"),
    (re.compile(r"blk\.(\d+)\.attn_k\.(weight|bias)"), "model.layers.{}.self_attn.k_proj.{}"),
    (re.compile(r"blk\.(\d+)\.attn_v\.(weight|bias)"), "model.layers.{}.self_attn.v_proj.{}"),
    (re.compile(r"blk\.(\d+)\.attn_output\.(weight|bias)"), "model.layers.{}.self_attn.o_proj.{}"),
    (re.compile(r"blk\.(\d+)\.attn_sinks\.weight"), "model.layers.{}.self_attn.sinks"),
    (re.compile(r"blk\.(\d+)\.post_attention_norm\.weight"), "model.layers.{}.post_attention_layernorm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_q_norm\.weight"), "model.layers.{}.self_attn.q_norm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_k_norm\.weight"), "model.layers.{}.self_attn.k_norm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_gate\.weight"), "model.layers.{}.mlp.gate_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_up\.weight"), "model.layers.{}.mlp.up_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_down\.weight"), "model.layers.{}.mlp.down_proj.weight"),
    # Mixtures of experts: the router and the experts stacked [E, out, in] (gpt-oss: with biases),
    # the names models.expert_tensors shows every checkpoint's experts under; older Mixtral files
    # hold one tensor per expert; Qwen2-MoE's shared expert and its gate.
    (re.compile(r"blk\.(\d+)\.ffn_gate_inp\.(weight|bias)"), "model.layers.{}.mlp.router.{}"),
    (re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight"), "model.layers.{}.mlp.experts.{}_proj"),
    (re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.bias"), "model.layers.{}.mlp.experts.{}_proj_bias"),
    (re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight"), "model.layers.{0}.mlp.experts.{2}.{1}_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight"), "model.layers.{}.mlp.shared_expert_gate.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight"), "model.layers.{}.mlp.shared_expert.{}_proj.weight"),
]
# The GGUF architectures of mixtures of experts read here (a llama file with experts is a
# Mixtral); others: an error naming their tensors.
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "gpt-oss")
# Whether each one renormalises the chosen experts' weights (llama.cpp's choice per architecture)
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "gpt-oss": True}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str | None:
    for pattern, template in _GGUF_NAMES:
        if m := pattern.fullmatch(name):
            hf = template.format(*m.groups())
            # The router is ``mlp.router`` in gpt-oss's checkpoints, ``mlp.gate`` in the others'.
            return hf if arch == "gpt-oss" else hf.replace(".mlp.router.weight", ".mlp.gate.weight")
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's Q/K rows from the half-split RoPE
    layout to interleaved pairs: [h, 2, H/2, ...] -> [h, H/2, 2, ...]."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | os.PathLike, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A GGUF file -> (config, HF-named tensors): float32, dequantised with the ``gguf`` package,
    or with ``keep_quantized`` the projections and embedding whose blocks the engine's layout
    holds exactly (``_KEPT``) as their values, scales and offsets (``models.quantization``)."""
    from gguf import quants
    from transformers import AutoConfig

    path = Path(path)
    reader = open_gguf(path)
    if "general.architecture" not in reader.fields:
        raise CheckpointFileError(path, "GGUF metadata has no general.architecture")
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    try:
        hf_config = _gpt_oss_config(reader) if arch == "gpt-oss" else \
            AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:      # transformers raises ValueError, KeyError, TypeError, its own validation errors
        raise CheckpointFileError(path, f"transformers cannot read its metadata as a {arch} model config ({error})") \
            from error
    cfg = ModelConfig.from_hf(hf_config)
    if arch in MOE_ARCHITECTURES or f"{arch}.expert_count" in reader.fields:
        cfg = _with_experts(cfg, reader, arch)
    if keep_quantized:
        cfg = cfg.replace(quantization=_kept_plan(reader, arch, cfg))
    tensors, unknown = {}, []
    for t in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", leave=False):
        hf_name = gguf_name_to_hf(t.name, arch)
        if hf_name is None:
            unknown.append(t.name)
            continue
        spec = cfg.quant_spec(kind) if (kind := kind_of(hf_name)) else None
        if spec is None:
            parts = {"": quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
                tuple(reversed(t.shape.tolist())))}
        else:
            parts = dict(zip(("", ":scale", ":offset"), _kept_blocks(t, spec)))
        for suffix, w in parts.items():
            if w is not None:
                tensors[hf_name + suffix] = _to_checkpoint_layout(w, hf_name, arch, cfg)
    if unknown:
        raise ValueError(f"{path.name}: tensors with no mapping: {sorted(unknown)}")
    return cfg, tensors


def _to_checkpoint_layout(w: np.ndarray, hf_name: str, arch: str, cfg: ModelConfig) -> np.ndarray:
    """A tensor (or its quantized values, scales, offsets: rows are output rows all the same) as
    the Hugging Face checkpoint holds it."""
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rope_rows(w, cfg.num_heads)
    if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rope_rows(w, cfg.num_kv_heads)
    if hf_name.endswith("shared_expert_gate.weight"):
        return w.reshape(1, -1)                    # a vector in the file, [1, D] in the checkpoint
    return w


# GGUF block types whose every weight the engine's layout holds exactly -> (format, group, offset):
# Q8_0 (int8, a scale per 32), Q4_0 (int4 - 8, a scale per 32: offset -8 * scale, exact in f16),
# Q4_1 (int4, a scale and a minimum per 32); the K-quants, whose scales are products of a float16
# and a 6- or 8-bit integer (exact in float32): Q4_K (int4, per 32 a scale d * sc and an offset
# -dmin * m), Q5_K (values 0..31 as int8, the same), Q6_K (values -32..31 as int8, per 16 a scale
# d * sc).
_KEPT = {"Q8_0": ("int8", 32, False), "Q4_0": ("int4", 32, True), "Q4_1": ("int4", 32, True),
         "Q4_K": ("int4-f32", 32, True), "Q5_K": ("int8-f32", 32, True), "Q6_K": ("int8-f32", 16, False)}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _kept_plan(reader, arch: str, cfg: ModelConfig) -> tuple[tuple[str, str, int, bool], ...]:
    """The kinds of weight kept quantized: those all of whose tensors are of ``_KEPT``'s types, in
    a format that holds each of them: int8 where any is (int4 values 0..15 held as int8, exact),
    float32 scales where any has them, the largest group that divides every type's, an offset where
    any has one. o_proj only where a group stays within a head (``models.quantization``)."""
    types = collections.defaultdict(set)
    for t in reader.tensors:
        if (hf_name := gguf_name_to_hf(t.name, arch)) and (kind := kind_of(hf_name)):
            types[kind].add(t.tensor_type.name)
    plan = []
    for kind, names in sorted(types.items()):
        if not names <= _KEPT.keys():
            continue
        specs = [_KEPT[n] for n in names]
        group = math.gcd(*(g for _, g, _ in specs))
        if kind == "o_proj" and cfg.head_dim % group:
            continue
        bits = 4 if all(FORMATS[f].bits == 4 for f, _, _ in specs) else 8
        wide = any(FORMATS[f].scale == np.float32 for f, _, _ in specs)
        plan.append((kind, f"int{bits}" + ("-f32" if wide else ""), group, any(o for _, _, o in specs)))
    return tuple(plan)


def _kept_blocks(t, spec: tuple[str, int, bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A tensor of one of ``_KEPT``'s types -> values [.., out, in], scales and offsets [.., out, in / G]
    (a mixture's experts: [E, out, in]), in ``spec``'s format and group (a type's own group repeated
    where the spec's is smaller)."""
    kind = t.tensor_type.name
    rows = tuple(reversed(t.shape.tolist()))[:-1]            # every axis but the blocks' own
    values, scale, offset, group = _k_quant_parts(t, rows) if kind.endswith("_K") else _block_parts(t, rows)
    fmt, plan_group, has_offset = spec
    stored = FORMATS[fmt]
    values = values.astype(stored.values)
    if has_offset and offset is None:
        offset = np.zeros_like(scale)

    def regroup(a):
        return None if a is None else np.repeat(a, group // plan_group, axis=-1).astype(stored.scale)
    return values, regroup(scale), regroup(offset)


def _block_parts(t, rows: tuple[int, ...]):
    """Q8_0 / Q4_0 / Q4_1 blocks -> (values int8 or uint8 0..15, float16 scales, offsets or None, 32),
    each [*rows, ...]."""
    kind = t.tensor_type.name
    blocks = np.asarray(t.data, np.uint8).reshape(*rows, -1, _BLOCK_BYTES[kind])
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if kind == "Q8_0":
        values, offset = np.ascontiguousarray(blocks[..., 2:]).view(np.int8), None
    else:
        packed = blocks[..., 2:] if kind == "Q4_0" else blocks[..., 4:]
        values = np.concatenate([packed & 15, packed >> 4], axis=-1)     # elements 0-15 low, 16-31 high
        offset = (-8 * scale.astype(np.float32)).astype(np.float16) if kind == "Q4_0" else \
            np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    return values.reshape(*rows, -1), scale, offset, 32


# Byte ranges of a K-quant super-block (256 weights): its float16 d (and dmin) and its values'
# bytes, with the bytes that make every value 1 (Q6_K: 33, stored as value - 32).
_K_LAYOUT = {"Q4_K": dict(d=slice(0, 2), dmin=slice(2, 4), values=[(slice(16, 144), 0x11)], group=32),
             "Q5_K": dict(d=slice(0, 2), dmin=slice(2, 4), values=[(slice(16, 48), 0), (slice(48, 176), 0x11)],
                          group=32),
             "Q6_K": dict(d=slice(208, 210), dmin=None, values=[(slice(0, 128), 0x11), (slice(128, 192), 0xAA)],
                          group=16)}


def _k_quant_parts(t, shape: tuple[int, ...]):
    """Q4_K / Q5_K / Q6_K super-blocks -> (values, float32 scales d * sc, offsets -dmin * m or
    None, the group), each [*shape, ...]. The sub-blocks' packed 6-bit scales are read by the
    ``gguf`` package's own dequantisation of altered copies of the blocks: with d = 1 and dmin = 0
    it gives sc * q, with every value 1 as well sc, with every value 0 (and d as stored) -dmin * m."""
    from gguf import quants

    layout = _K_LAYOUT[t.tensor_type.name]
    rows = math.prod(shape)
    blocks = np.asarray(t.data, np.uint8).reshape(rows, -1)

    def dequantized(b: np.ndarray) -> np.ndarray:
        return quants.dequantize(b, t.tensor_type).astype(np.float32).reshape(rows, -1)

    def altered(d=None, dmin=None, value_bytes=None) -> np.ndarray:
        b = blocks.reshape(-1, _k_block_bytes(t)).copy()
        if d is not None:
            b[:, layout["d"]] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if dmin is not None and layout["dmin"] is not None:
            b[:, layout["dmin"]] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
        for span, byte in value_bytes or ():
            b[:, span] = byte
        return b.reshape(blocks.shape)

    group = layout["group"]
    scaled = dequantized(altered(d=1, dmin=0))                                   # sc * q
    sc = dequantized(altered(d=1, dmin=0, value_bytes=layout["values"]))         # sc
    values = np.rint(np.divide(scaled, sc, out=np.zeros_like(scaled), where=sc != 0))
    d = np.ascontiguousarray(blocks.reshape(-1, _k_block_bytes(t))[:, layout["d"]]).view(np.float16)
    d = np.repeat(d.astype(np.float32).reshape(rows, -1), 256 // group, axis=-1)
    first = sc.reshape(rows, -1, group)[..., 0]
    offset = None
    if layout["dmin"] is not None:
        zero_values = [(span, 0) for span, _ in layout["values"]]
        offset = dequantized(altered(value_bytes=zero_values)).reshape(rows, -1, group)[..., 0]    # -dmin * m
    def shaped(a):
        return None if a is None else a.reshape(*shape, -1)
    return shaped(values.astype(np.int16)), shaped(d * first), shaped(offset), group


def _k_block_bytes(t) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[t.tensor_type][1]


def _with_experts(cfg: ModelConfig, reader, arch: str) -> ModelConfig:
    """The experts' shape from the GGUF metadata itself (transformers' GGUF config mapping leaves
    the expert width, the shared expert and gpt-oss's head size at their defaults)."""
    def field(name: str, default: int | None = None) -> int:
        key = f"{arch}.{name}"
        if key not in reader.fields:
            if default is not None:
                return default
            raise ValueError(f"GGUF metadata: {key} missing (a mixture of experts needs it)")
        return int(reader.fields[key].parts[-1][0])

    changes = dict(num_experts=field("expert_count"), num_experts_per_tok=field("expert_used_count"),
                   moe_intermediate_size=field("expert_feed_forward_length", cfg.intermediate_size),
                   norm_topk_prob=_NORM_TOPK.get(arch, True), dense_layers=())
    if arch == "llama":
        changes["architecture"] = "MixtralForCausalLM"
    if arch == "qwen2moe":
        changes["shared_expert_intermediate_size"] = field("expert_shared_feed_forward_length", 0)
    if arch == "gpt-oss":
        changes["head_dim"] = field("attention.key_length", cfg.head_dim)
        if isinstance(cfg.rope_scaling, YarnScaling):      # gpt-oss's YaRN does not round its band
            changes["rope_scaling"] = dataclasses.replace(cfg.rope_scaling, truncate=False)
    return cfg.replace(**changes)


def _gpt_oss_config(reader):
    """gpt-oss's transformers config from the GGUF metadata, read here: transformers' own GGUF
    reading of it fails on the YaRN keys llama.cpp writes."""
    import gguf
    from transformers import GptOssConfig

    def value(key: str, default=None):
        field = reader.fields.get(f"gpt-oss.{key}")
        if field is None:
            return default
        raw = field.parts[field.data[0]]
        return bytes(raw).decode() if field.types and field.types[0] == gguf.GGUFValueType.STRING else raw[0].item()

    heads = value("attention.head_count")
    rope = {"rope_type": "yarn", "factor": float(value("rope.scaling.factor", 32.0)), "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "rope_theta": float(value("rope.freq_base", 150000.0)),
            "original_max_position_embeddings": int(value("rope.scaling.original_context_length", 4096))}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = value("vocab_size") or (len(tokens.data) if tokens is not None else None)
    return GptOssConfig(
        num_hidden_layers=value("block_count"), max_position_embeddings=value("context_length"),
        hidden_size=value("embedding_length"), intermediate_size=value("expert_feed_forward_length"),
        num_attention_heads=heads, num_key_value_heads=value("attention.head_count_kv", heads),
        head_dim=value("attention.key_length"), rms_norm_eps=float(value("attention.layer_norm_rms_epsilon", 1e-5)),
        sliding_window=value("attention.sliding_window", value("sliding_window", 128)), vocab_size=vocab,
        num_local_experts=value("expert_count"), num_experts_per_tok=value("expert_used_count"),
        rope_parameters=rope, architectures=["GptOssForCausalLM"])


def open_gguf(path: str | os.PathLike):
    """The ``gguf`` package's reader of the file: FileNotFoundError naming a missing one,
    CheckpointFileError naming one the reader cannot parse (truncated, corrupt, not a GGUF)."""
    import gguf

    path = require_gguf(path)
    try:
        return gguf.GGUFReader(path)
    # what the reader raises on bad bytes (a cut-off array, an unknown type code, bad UTF-8, an
    # index past the end)
    except (ValueError, IndexError, KeyError, OverflowError) as error:
        raise CheckpointFileError(path, _gguf_problem(path, error)) from error


def require_gguf(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file" + (" (it is a folder)" if path.is_dir() else ""))
    return path


def _gguf_problem(path: Path, error: Exception) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if size == 0:
        return "empty file, not a GGUF file"
    if not b"GGUF".startswith(magic):
        return f"not a GGUF file (it starts with {magic!r}, not b'GGUF')"
    return f"truncated or corrupt GGUF file ({size} bytes; reading it failed: {error})"


def gguf_dtype(path: str | os.PathLike) -> str:
    """``float32`` / ``float16`` if all of the file's tensors are, else ``quantized``."""
    kinds = {t.tensor_type.name for t in open_gguf(path).tensors}
    return "float32" if kinds <= {"F32"} else "float16" if kinds <= {"F32", "F16"} else "quantized"


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, *, mesh=None, keep_quantized: bool = True,
              **model_kwargs):
    """A GGUF file -> (model, whether the converted-weights cache had it). The first time, the
    file is converted once (its Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K projections kept quantized with
    ``keep_quantized``, the rest dequantised) and saved to the cache; the model always comes
    from the cache, so the converted tensors are freed before anything is placed."""
    path = require_gguf(path)
    cached = converted_cache_path(path, "" if keep_quantized else "dequantized")
    hit = (cfg := cached_config(cached)) is not None
    if not hit:
        cfg, tensors = read_gguf(path, keep_quantized)
        save_converted(cached, cfg, tensors)
        del tensors
    return restore_converted(cached, cfg, dtype, mesh=mesh, **model_kwargs), hit
