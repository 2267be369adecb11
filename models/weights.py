"""Checkpoints -> NNX state: Hugging Face safetensors folders and GGUF files.

Both readers give tensors under Hugging Face names in Hugging Face layout ([out, in]); a layout
per tensor turns those into the model's einsum layout. Parameters are placed one device's slice
at a time, and a slice reads only the part of each HF tensor it comes from (a safetensors file is
read lazily), so no host holds the whole model (a GGUF does, once, while it is dequantised). The
converted GGUF is cached with orbax in our layout (with its config): a later start skips parsing
and dequantisation and restores each device's shard straight into place.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from tqdm.auto import tqdm

from jaxengine.models.config import ModelConfig, RopeScaling
from jaxengine.models.registry import get_model_class
from jaxengine.parallel.mesh import kv_head_repeats, make_mesh, mesh_model_config, mesh_size, param_shardings

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


class SafetensorsSource(contextlib.AbstractContextManager):
    """The tensors of safetensors files, each file opened once (memory-mapped): a slice reads only
    its own bytes. Which file holds a tensor comes from the files' headers. numpy has no
    bfloat16, so a file holding bfloat16 tensors (most checkpoints) is read through JAX's view
    of it and handed on as an ml_dtypes array."""

    def __init__(self, files: Iterable[str | os.PathLike]) -> None:
        from safetensors import safe_open

        self._files = contextlib.ExitStack()
        self._handles = {}
        for file in files:
            handle = self._files.enter_context(safe_open(file, framework="numpy"))
            if any(handle.get_slice(name).get_dtype() == "BF16" for name in handle.keys()):
                handle = self._files.enter_context(safe_open(file, framework="flax"))
            self._handles.update(dict.fromkeys(handle.keys(), handle))

    def names(self) -> Iterable[str]:
        return self._handles.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str, index: Index) -> np.ndarray:
        return np.asarray(self._handles[name].get_slice(name)[index])

    def __exit__(self, *exc) -> None:
        self._files.close()


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


# Hugging Face name -> (our path, layout). The layer index is the pattern's first group.
_LAYER = r"model\.layers\.(\d+)\."


def _rules(cfg: ModelConfig) -> list[tuple[re.Pattern, Callable[[re.Match], ParamPath], object]]:
    h = cfg.head_dim

    def layer(*rest):
        return lambda m: ("layers", int(m.group(1)), *rest)

    return [
        (re.compile(r"model\.embed_tokens\.weight"), lambda m: ("embed_tokens",), Same()),
        (re.compile(r"model\.norm\.weight"), lambda m: ("norm", "weight"), Same()),
        (re.compile(r"lm_head\.weight"), lambda m: ("lm_head",), Transposed()),
        (re.compile(_LAYER + r"self_attn\.q_proj\.weight"), layer("self_attn", "q_proj"), HeadsIn(h)),
        (re.compile(_LAYER + r"self_attn\.k_proj\.weight"), layer("self_attn", "k_proj"), HeadsIn(h)),
        (re.compile(_LAYER + r"self_attn\.v_proj\.weight"), layer("self_attn", "v_proj"), HeadsIn(h)),
        (re.compile(_LAYER + r"self_attn\.o_proj\.weight"), layer("self_attn", "o_proj"), HeadsOut(h)),
        (re.compile(_LAYER + r"self_attn\.q_proj\.bias"), layer("self_attn", "q_bias"), HeadsBias(h)),
        (re.compile(_LAYER + r"self_attn\.k_proj\.bias"), layer("self_attn", "k_bias"), HeadsBias(h)),
        (re.compile(_LAYER + r"self_attn\.v_proj\.bias"), layer("self_attn", "v_bias"), HeadsBias(h)),
        (re.compile(_LAYER + r"self_attn\.q_norm\.weight"), layer("self_attn", "q_norm", "weight"), Same()),
        (re.compile(_LAYER + r"self_attn\.k_norm\.weight"), layer("self_attn", "k_norm", "weight"), Same()),
        (re.compile(_LAYER + r"mlp\.gate_proj\.weight"), layer("mlp", "gate_proj"), Transposed()),
        (re.compile(_LAYER + r"mlp\.up_proj\.weight"), layer("mlp", "up_proj"), Transposed()),
        (re.compile(_LAYER + r"mlp\.down_proj\.weight"), layer("mlp", "down_proj"), Transposed()),
        (re.compile(_LAYER + r"input_layernorm\.weight"), layer("input_layernorm", "weight"), Same()),
        (re.compile(_LAYER + r"post_attention_layernorm\.weight"), layer("post_attention_layernorm", "weight"), Same()),
    ]


_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_KV_HEAD_AXIS = {"k_proj": 1, "v_proj": 1, "k_bias": 0, "v_bias": 0}      # in our per-layer layout

Located = dict[ParamPath, tuple[str, object]]      # our per-layer path -> (HF name, layout)


def locate_tensors(source: TensorSource, cfg: ModelConfig, kv_repeats: int = 1) -> tuple[Located, list[str]]:
    """Where each of our per-layer parameters comes from, plus the HF names nothing maps."""
    rules = _rules(cfg)
    located, unexpected = {}, []
    for name in source.names():
        if _IGNORED.match(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        for pattern, path, layout in rules:
            if m := pattern.fullmatch(name):
                p = path(m)
                axis = _KV_HEAD_AXIS.get(p[-1]) if p[0] == "layers" else None
                if kv_repeats > 1 and axis is not None:
                    layout = RepeatedHeads(layout, axis, kv_repeats)
                located[p] = (name, layout)
                break
        else:
            unexpected.append(name)
    return located, unexpected


def _check(located: Located, unexpected: list[str], source: TensorSource, flat, cfg: ModelConfig) -> None:
    """ValueError naming every missing, unexpected and misshapen tensor."""
    expected = {q for p, _ in flat for q in _per_layer(p, cfg.num_layers)}
    missing = [_path_name(p) for p in sorted(expected - located.keys(), key=str)]
    unexpected = unexpected + [_path_name(p) for p in located.keys() - expected]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cfg.architecture}: missing tensors {sorted(missing)}; "
                         f"unexpected tensors {sorted(unexpected)}")
    for path, var in flat:
        per_layer_shape = tuple(var.shape[1:]) if path[0] == "layers" else tuple(var.shape)
        for p in _per_layer(path, cfg.num_layers):
            name, layout = located[p]
            if source.shape(name) != (want := layout.hf_shape(per_layer_shape)):
                raise ValueError(f"tensor {_path_name(p)}: shape {source.shape(name)} in the checkpoint, "
                                 f"{want} expected")


def read_param(source: TensorSource, located: Located, path: ParamPath, index: Index, dtype) -> np.ndarray:
    """The slice ``index`` of parameter ``path`` (our stacked layout, [L, ...] for layers), read
    from its HF tensors as ``dtype``. Layers are written one at a time into the result, so the
    host holds the slice plus one layer's part in flight."""
    if path[0] != "layers":
        name, layout = located[path]
        return np.ascontiguousarray(layout.read(functools.partial(source.read, name), index), dtype)
    layers = range(index[0].start, index[0].stop)
    out = np.empty([len(layers)] + [s.stop - s.start for s in index[1:]], dtype)
    for i, layer in enumerate(layers):
        name, layout = located[("layers", layer, *path[1:])]
        out[i] = layout.read(functools.partial(source.read, name), index[1:])
    return out


def place(read: Callable[[Index], np.ndarray], shape: tuple, sharding: jax.sharding.Sharding) -> jax.Array:
    """An array of ``shape`` in ``sharding``, each device's slice read on its own (a slice two
    devices share is read once)."""
    devices_of = collections.defaultdict(list)      # keyed by bounds: slices are unhashable before 3.12
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        devices_of[tuple(s.indices(n)[:2] for s, n in zip(index, shape))].append(device)
    shards = []
    for bounds, devices in devices_of.items():
        part = read(tuple(slice(start, stop) for start, stop in bounds))
        shards += [_copy_to(part, d) for d in devices]
        del part
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _copy_to(part: np.ndarray, device: jax.Device) -> jax.Array:
    """``part`` copied to ``device``. The CPU backend may adopt an aligned host array as the device
    buffer itself; a copy there keeps device buffers apart from the host arrays of the load, so
    host memory holds only the slices in flight, as with an accelerator."""
    on_device = jax.device_put(part, device)
    return jax.device_put(on_device, device, may_alias=False) if device.platform == "cpu" else on_device


def _abstract_model(cfg: ModelConfig, dtype, model_kwargs: dict):
    """(graphdef, state) of the model for ``cfg`` with nothing allocated."""
    model_cls = get_model_class(cfg.architecture)
    return nnx.split(nnx.eval_shape(lambda: model_cls(cfg, dtype, rngs=nnx.Rngs(0), **model_kwargs)))


def _mesh_or_first_device(mesh) -> jax.sharding.Mesh:
    return mesh if mesh is not None else make_mesh(jax.devices()[:1])


def _flat_shardings(state: nnx.State, mesh) -> list:
    return [s.get_value() if hasattr(s, "get_value") else s
            for _, s in nnx.to_flat_state(param_shardings(state, mesh))]


def build_model(cfg: ModelConfig, tensors: TensorSource | Mapping[str, np.ndarray], dtype=jnp.float32, *,
                mesh=None, **model_kwargs):
    """Instantiate the model for ``cfg`` with the given HF-named tensors (a dict or a lazy
    ``TensorSource``), checked one by one. Each parameter is placed straight into its sharding
    on ``mesh`` (default: the first device), one device's slice at a time; when there are fewer
    KV heads than devices they are repeated (the model then has ``mesh_model_config``'s)."""
    source = tensors if isinstance(tensors, TensorSource) else ArraySource(tensors)
    mesh = _mesh_or_first_device(mesh)
    located, unexpected = locate_tensors(source, cfg, kv_head_repeats(cfg, mesh_size(mesh)))
    cfg = mesh_model_config(cfg, mesh_size(mesh))
    graphdef, state = _abstract_model(cfg, dtype, model_kwargs)
    flat = nnx.to_flat_state(state)
    _check(located, unexpected, source, flat, cfg)
    for (path, var), sharding in zip(flat, _flat_shardings(state, mesh)):
        read = functools.partial(read_param, source, located, path, dtype=dtype)
        var.set_value(place(read, tuple(var.shape), sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _per_layer(path: ParamPath, num_layers: int) -> list[ParamPath]:
    """A stacked layer parameter ('layers', ...) stands for ('layers', i, ...) of every layer."""
    if path[0] != "layers":
        return [path]
    return [("layers", i, *path[1:]) for i in range(num_layers)]


def _path_name(path: ParamPath) -> str:
    return ".".join(str(p) for p in path)


# ---------------------------------------------------------------- safetensors folders
def safetensors_files(folder: str | os.PathLike) -> tuple[ModelConfig, list[Path]]:
    """``config.json`` + one or many ``*.safetensors`` shards (``model.safetensors.index.json``)."""
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
    return cfg, [folder / name for name in files]


def read_safetensors_folder(folder: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Every tensor of a checkpoint folder, read in full (``load_model`` reads lazily instead)."""
    from safetensors.numpy import load_file

    cfg, files = safetensors_files(folder)
    return cfg, {name: w for file in files for name, w in load_file(file).items()}


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


# In the cache folder: the parameters as an orbax checkpoint, in our stacked layout, float32, KV
# heads as the checkpoint has them; config.json, written last, marks it complete. (A folder of
# the earlier format, model.safetensors, has no params: it is rebuilt.)
_PARAMS = "params"


def cached_config(cached: Path) -> ModelConfig | None:
    """The config of a complete converted-weights cache folder, else None."""
    if not ((cached / "config.json").exists() and (cached / _PARAMS).is_dir()):
        return None
    raw = json.loads((cached / "config.json").read_text())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    return ModelConfig(**raw)


def save_converted(cached: Path, cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    """HF-named tensors -> the cache folder, laid out as our parameters (checked as a load is)."""
    import orbax.checkpoint as ocp          # here: its import takes most of a second

    source = ArraySource(tensors)
    located, unexpected = locate_tensors(source, cfg)
    _, state = _abstract_model(cfg, jnp.float32, {})
    flat = nnx.to_flat_state(state)
    _check(located, unexpected, source, flat, cfg)
    params = {path: read_param(source, located, path, tuple(slice(0, n) for n in var.shape), np.float32)
              for path, var in flat}
    cached.mkdir(parents=True, exist_ok=True)
    (cached / "config.json").unlink(missing_ok=True)
    (cached / "model.safetensors").unlink(missing_ok=True)       # the earlier format's
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((cached / _PARAMS).absolute(), traverse_util.unflatten_dict(params), force=True)
    (cached / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))


def restore_converted(cached: Path, cfg: ModelConfig, dtype=jnp.float32, *, mesh=None, **model_kwargs):
    """The model from a converted-weights cache folder, each device's shard of each parameter read
    straight into place (orbax, with abstract arrays carrying the target shardings). KV heads
    fewer than devices are restored replicated, then repeated on the devices."""
    import orbax.checkpoint as ocp

    mesh = _mesh_or_first_device(mesh)
    _, saved = _abstract_model(cfg, dtype, {})
    target = {path: jax.ShapeDtypeStruct(var.shape, dtype, sharding=sharding)
              for (path, var), sharding in zip(nnx.to_flat_state(saved), _flat_shardings(saved, mesh))}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = traverse_util.flatten_dict(
            checkpointer.restore((cached / _PARAMS).absolute(), traverse_util.unflatten_dict(target)))
    repeats = kv_head_repeats(cfg, mesh_size(mesh))
    graphdef, state = _abstract_model(mesh_model_config(cfg, mesh_size(mesh)), dtype, model_kwargs)
    flat = nnx.to_flat_state(state)
    for (path, var), sharding in zip(flat, _flat_shardings(state, mesh)):
        value = restored[path]
        if repeats > 1 and path[-1] in _KV_HEAD_AXIS:
            value = _repeat_heads(value, 1 + _KV_HEAD_AXIS[path[-1]], repeats, sharding)
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _repeat_heads(w: jax.Array, axis: int, repeats: int, sharding) -> jax.Array:
    """Each head ``repeats`` times in a row, on the devices: each keeps only its own copy."""
    return jax.jit(functools.partial(jnp.repeat, repeats=repeats, axis=axis), out_shardings=sharding)(w)


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


def load_model(path: str | os.PathLike, dtype=jnp.float32, *, mesh=None, **model_kwargs):
    """A checkpoint folder or a .gguf file -> (model, config); with a ``mesh``, the model and
    config as the mesh runs them (``build_model``)."""
    path = Path(path)
    if path.suffix == ".gguf":
        model, _ = load_gguf(path, dtype, mesh=mesh, **model_kwargs)
    else:
        cfg, files = safetensors_files(path)
        with SafetensorsSource(files) as source:
            model = build_model(cfg, source, dtype, mesh=mesh, **model_kwargs)
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
