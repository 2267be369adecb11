"""Checkpoints -> NNX state: Hugging Face safetensors folders and GGUF files.

Both readers produce tensors under Hugging Face names in Hugging Face layout ([out, in]); one
mapping turns those into the model's einsum layout. A converted GGUF is cached as safetensors
(with its config) so a second start skips parsing and dequantisation.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxengine.models.config import ModelConfig
from jaxengine.models.registry import get_model_class

ParamPath = tuple

# Hugging Face name -> (our path, transform from HF layout). {i} is the layer index.
_LAYER = r"model\.layers\.(\d+)\."


def _rules(cfg: ModelConfig) -> list[tuple[re.Pattern, Callable[[re.Match], ParamPath], Callable]]:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def layer(*rest):
        return lambda m: ("layers", int(m.group(1)), *rest)

    ident = lambda w: w  # noqa: E731
    return [
        (re.compile(r"model\.embed_tokens\.weight"), lambda m: ("embed_tokens",), ident),
        (re.compile(r"model\.norm\.weight"), lambda m: ("norm", "weight"), ident),
        (re.compile(r"lm_head\.weight"), lambda m: ("lm_head",), lambda w: w.T),
        (re.compile(_LAYER + r"self_attn\.q_proj\.weight"), layer("self_attn", "q_proj"), lambda w: w.T.reshape(d, n, h)),
        (re.compile(_LAYER + r"self_attn\.k_proj\.weight"), layer("self_attn", "k_proj"), lambda w: w.T.reshape(d, k, h)),
        (re.compile(_LAYER + r"self_attn\.v_proj\.weight"), layer("self_attn", "v_proj"), lambda w: w.T.reshape(d, k, h)),
        (re.compile(_LAYER + r"self_attn\.o_proj\.weight"), layer("self_attn", "o_proj"), lambda w: w.T.reshape(n, h, d)),
        (re.compile(_LAYER + r"self_attn\.q_proj\.bias"), layer("self_attn", "q_bias"), lambda w: w.reshape(n, h)),
        (re.compile(_LAYER + r"self_attn\.k_proj\.bias"), layer("self_attn", "k_bias"), lambda w: w.reshape(k, h)),
        (re.compile(_LAYER + r"self_attn\.v_proj\.bias"), layer("self_attn", "v_bias"), lambda w: w.reshape(k, h)),
        (re.compile(_LAYER + r"self_attn\.q_norm\.weight"), layer("self_attn", "q_norm", "weight"), ident),
        (re.compile(_LAYER + r"self_attn\.k_norm\.weight"), layer("self_attn", "k_norm", "weight"), ident),
        (re.compile(_LAYER + r"mlp\.gate_proj\.weight"), layer("mlp", "gate_proj"), lambda w: w.T),
        (re.compile(_LAYER + r"mlp\.up_proj\.weight"), layer("mlp", "up_proj"), lambda w: w.T),
        (re.compile(_LAYER + r"mlp\.down_proj\.weight"), layer("mlp", "down_proj"), lambda w: w.T),
        (re.compile(_LAYER + r"input_layernorm\.weight"), layer("input_layernorm", "weight"), ident),
        (re.compile(_LAYER + r"post_attention_layernorm\.weight"), layer("post_attention_layernorm", "weight"), ident),
    ]


_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def convert_hf_tensors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> tuple[dict[ParamPath, np.ndarray], list[str]]:
    """HF-named tensors -> {param path: array in our layout}, plus the names nothing maps."""
    rules = _rules(cfg)
    params, unexpected = {}, []
    for name, tensor in tensors.items():
        if _IGNORED.match(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        for pattern, path, transform in rules:
            if m := pattern.fullmatch(name):
                params[path(m)] = transform(np.asarray(tensor))
                break
        else:
            unexpected.append(name)
    return params, unexpected


def build_model(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32, *, mesh=None,
                **model_kwargs):
    """Instantiate the model for ``cfg`` with the given HF-named tensors, checked one by one.
    With a ``mesh`` each parameter is placed straight into its sharding, one device's slice at a
    time, and the KV heads are repeated when there are fewer of them than devices (the model then
    has ``parallel.mesh.mesh_model_config``'s KV heads)."""
    params, unexpected = convert_hf_tensors(tensors, cfg)
    if mesh is not None:
        from jaxengine.parallel.mesh import kv_head_repeats, mesh_model_config, mesh_size

        repeats = kv_head_repeats(cfg, mesh_size(mesh))
        params = {p: repeat_kv_heads(p, w, repeats) for p, w in params.items()}
        cfg = mesh_model_config(cfg, mesh_size(mesh))
    model_cls = get_model_class(cfg.architecture)
    abstract = nnx.eval_shape(lambda: model_cls(cfg, dtype, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, state = nnx.split(abstract)
    shardings = None
    if mesh is not None:
        from jaxengine.parallel.mesh import param_shardings

        shardings = nnx.to_flat_state(param_shardings(state, mesh))
    flat = nnx.to_flat_state(state)
    expected = {q for p, _ in flat for q in _per_layer(p, cfg.num_layers)}
    missing = [_path_name(p) for p in sorted(expected - params.keys(), key=str)]
    unexpected += [_path_name(p) for p in params.keys() - expected]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cfg.architecture}: missing tensors {sorted(missing)}; "
                         f"unexpected tensors {sorted(unexpected)}")
    for i, (path, var) in enumerate(flat):
        per_layer_shape = tuple(var.shape[1:]) if path[0] == "layers" else tuple(var.shape)
        for p in _per_layer(path, cfg.num_layers):
            if tuple(params[p].shape) != per_layer_shape:
                raise ValueError(f"tensor {_path_name(p)}: shape {tuple(params[p].shape)} in the checkpoint, "
                                 f"{per_layer_shape} expected")
        full = _stacked(params, path, cfg.num_layers)
        if shardings is None:
            var.set_value(jnp.asarray(full, dtype))
        else:
            sharding = shardings[i][1].get_value() if hasattr(shardings[i][1], "get_value") else shardings[i][1]
            var.set_value(jax.make_array_from_callback(full.shape, sharding,
                                                       lambda index, full=full: np.asarray(full[index], dtype)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


_KV_HEAD_AXIS = {"k_proj": 1, "v_proj": 1, "k_bias": 0, "v_bias": 0}      # in our per-layer layout


def repeat_kv_heads(path: ParamPath, w: np.ndarray, repeats: int) -> np.ndarray:
    """Each KV head ``repeats`` times in a row (head j -> j*r .. j*r + r - 1) for K/V weights."""
    axis = _KV_HEAD_AXIS.get(path[-1]) if path[0] == "layers" else None
    return w if repeats == 1 or axis is None else np.repeat(w, repeats, axis=axis)


def _per_layer(path: ParamPath, num_layers: int) -> list[ParamPath]:
    """A stacked layer parameter ('layers', ...) stands for ('layers', i, ...) of every layer."""
    if path[0] != "layers":
        return [path]
    return [("layers", i, *path[1:]) for i in range(num_layers)]


def _stacked(params: dict, path: ParamPath, num_layers: int) -> np.ndarray:
    if path[0] != "layers":
        return params[path]
    return np.stack([params[p] for p in _per_layer(path, num_layers)])


def _path_name(path: ParamPath) -> str:
    return ".".join(str(p) for p in path)


# ---------------------------------------------------------------- safetensors folders
def read_safetensors_folder(folder: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``config.json`` + one or many ``*.safetensors`` shards (``model.safetensors.index.json``)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: no config.json; --model must be a Hugging Face checkpoint folder or a .gguf file")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(folder, local_files_only=True))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(load_file(folder / name))
    return cfg, tensors


# ---------------------------------------------------------------- GGUF
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
]


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


# ---------------------------------------------------------------- converted-weights cache
def cache_dir() -> Path:
    return Path(os.environ.get("JAXENGINE_CACHE", Path.home() / ".cache" / "jaxengine"))


def converted_cache_path(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{path.stem}-{key}"


def read_gguf_cached(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], bool]:
    """Like ``read_gguf``, through the converted-weights cache. Returns (config, tensors, hit)."""
    import dataclasses

    from safetensors.numpy import load_file, save_file

    from jaxengine.models.config import RopeScaling

    path = Path(path)
    cached = converted_cache_path(path)
    if (cached / "config.json").exists() and (cached / "model.safetensors").exists():
        raw = json.loads((cached / "config.json").read_text())
        if raw.get("rope_scaling"):
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        return ModelConfig(**raw), load_file(cached / "model.safetensors"), True
    cfg, tensors = read_gguf(path)
    cached.mkdir(parents=True, exist_ok=True)
    tmp = cached / "model.safetensors.tmp"
    save_file(tensors, tmp)
    tmp.replace(cached / "model.safetensors")
    (cached / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return cfg, tensors, False


def load_model(path: str | os.PathLike, dtype=jnp.float32, *, mesh=None, **model_kwargs):
    """A checkpoint folder or a .gguf file -> (model, config); with a ``mesh``, the model and
    config as the mesh runs them (``build_model``)."""
    path = Path(path)
    if path.suffix == ".gguf":
        cfg, tensors, _ = read_gguf_cached(path)
    else:
        cfg, tensors = read_safetensors_folder(path)
    model = build_model(cfg, tensors, dtype, mesh=mesh, **model_kwargs)
    return model, model.config


# ---------------------------------------------------------------- checkpoint dtype
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(path: str | os.PathLike) -> str | None:
    """The dtype the checkpoint stores its weights in, without loading them: ``torch_dtype`` /
    ``dtype`` of config.json, else the first safetensors shard's most common tensor dtype; for a
    GGUF, ``float32`` / ``float16`` if all tensors are, else ``quantized``. None if unknown."""
    path = Path(path)
    if path.suffix == ".gguf":
        import gguf

        kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        return "float32" if kinds <= {"F32"} else "float16" if kinds <= {"F32", "F16"} else "quantized"
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if isinstance(named := config.get("torch_dtype") or config.get("dtype"), str):
        return named
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        return None
    with open(shards[0], "rb") as f:              # 8-byte header length, then the JSON header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    counts = collections.Counter(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return _SAFETENSORS_DTYPES.get(counts.most_common(1)[0][0]) if counts else None
