"""GGUF files: read and dequantised into HF-named tensors (with the ``gguf`` package), and loaded
through the converted-weights cache, so a file is dequantised once, not at every start."""
from __future__ import annotations

import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxengine.models.config import ModelConfig
from jaxengine.models.paths import converted_cache_path
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
    (re.compile(r"blk\.(\d+)\.attn_output\.weight"), "model.layers.{}.self_attn.o_proj.weight"),
    (re.compile(r"blk\.(\d+)\.attn_q_norm\.weight"), "model.layers.{}.self_attn.q_norm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_k_norm\.weight"), "model.layers.{}.self_attn.k_norm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_gate\.weight"), "model.layers.{}.mlp.gate_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_up\.weight"), "model.layers.{}.mlp.up_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_down\.weight"), "model.layers.{}.mlp.down_proj.weight"),
    # a mixture of experts (llama.cpp's qwen3moe): the router and the experts stacked [E, out, in],
    # the names models.expert_tensors shows every checkpoint's experts under
    (re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight"), "model.layers.{}.mlp.gate.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_gate_exps\.weight"), "model.layers.{}.mlp.experts.gate_proj"),
    (re.compile(r"blk\.(\d+)\.ffn_up_exps\.weight"), "model.layers.{}.mlp.experts.up_proj"),
    (re.compile(r"blk\.(\d+)\.ffn_down_exps\.weight"), "model.layers.{}.mlp.experts.down_proj"),
]
# The GGUF architectures of mixtures of experts read here (others: an error naming their tensors)
MOE_ARCHITECTURES = ("qwen3moe",)


def gguf_name_to_hf(name: str) -> str | None:
    for pattern, template in _GGUF_NAMES:
        if m := pattern.fullmatch(name):
            return template.format(*m.groups())
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's Q/K rows from the half-split RoPE
    layout to interleaved pairs: [h, 2, H/2, ...] -> [h, H/2, 2, ...]."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A GGUF file -> (config, HF-named float32 tensors), dequantised with the ``gguf`` package."""
    import gguf
    from gguf import quants
    from transformers import AutoConfig

    path = Path(path)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch in MOE_ARCHITECTURES:
        cfg = _with_experts(cfg, reader, arch)
    tensors, unknown = {}, []
    for t in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", leave=False):
        hf_name = gguf_name_to_hf(t.name)
        if hf_name is None:
            unknown.append(t.name)
            continue
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        tensors[hf_name] = w
    if unknown:
        raise ValueError(f"{path.name}: tensors with no mapping: {sorted(unknown)}")
    return cfg, tensors


def _with_experts(cfg: ModelConfig, reader, arch: str) -> ModelConfig:
    """The experts' shape from the GGUF metadata itself (transformers' GGUF config mapping leaves
    the expert width at its default)."""
    def field(name: str) -> int:
        key = f"{arch}.{name}"
        if key not in reader.fields:
            raise ValueError(f"GGUF metadata: {key} missing (a mixture of experts needs it)")
        return int(reader.fields[key].parts[-1][0])

    return cfg.replace(num_experts=field("expert_count"), num_experts_per_tok=field("expert_used_count"),
                       moe_intermediate_size=field("expert_feed_forward_length"), norm_topk_prob=True)


def gguf_dtype(path: str | os.PathLike) -> str:
    """``float32`` / ``float16`` if all of the file's tensors are, else ``quantized``."""
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    return "float32" if kinds <= {"F32"} else "float16" if kinds <= {"F32", "F16"} else "quantized"


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, *, mesh=None, **model_kwargs):
    """A GGUF file -> (model, whether the converted-weights cache had it). The first time, the
    file is dequantised and converted once and saved to the cache; the model always comes from
    the cache, so the converted tensors are freed before anything is placed."""
    path = Path(path)
    cached = converted_cache_path(path)
    hit = (cfg := cached_config(cached)) is not None
    if not hit:
        cfg, tensors = read_gguf(path)
        save_converted(cached, cfg, tensors)
        del tensors
    return restore_converted(cached, cfg, dtype, mesh=mesh, **model_kwargs), hit
