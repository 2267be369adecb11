"""Checkpoints -> NNX models: ``load_model`` takes a Hugging Face safetensors folder (read here)
or a GGUF file (``models.gguf``).

Parameters are placed one device's slice at a time, and a slice reads only the part of each HF
tensor it comes from (``models.hf_tensors``; a safetensors file is read lazily), so no host holds
the whole model (a GGUF is held once, while it is dequantised).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.config import ModelConfig, check_config_fields
from jaxengine.models.expert_tensors import ExpertTensors
from jaxengine.models.gguf import gguf_dtype, load_gguf
from jaxengine.models.hf_tensors import ArraySource, Index, TensorSource, check_tensors, locate_tensors, read_param
from jaxengine.models.mtp import MTPTensors, mtp_config
from jaxengine.paths import CheckpointFileError, read_json_object
from jaxengine.models.mesh import (check_expert_parallel, flat_param_shardings, kv_head_repeats, mesh_model_config, mesh_or_first_device,
                                   mesh_size)
from jaxengine.models.panels import panel_for_cpu
from jaxengine.models.quantization import SCHEMES, QuantizingSource, online_plan, param_dtype, tile_for_cpu
from jaxengine.models.registry import abstract_model
from jaxengine.models.stored_quantization import KV_SCALE, StoredQuantizationSource, stored_plan, stored_weights


# ---------------------------------------------------------------- HF-named tensors -> the model
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


def build_model(cfg: ModelConfig, tensors: TensorSource | Mapping[str, np.ndarray], dtype=jnp.float32, *,
                mesh=None, **model_kwargs):
    """Instantiate the model for ``cfg`` with the given HF-named tensors (a dict or a lazy
    ``TensorSource``), checked one by one. Each parameter is placed straight into its sharding
    on ``mesh`` (default: the first device), one device's slice at a time; when there are fewer
    KV heads than devices they are repeated (the model then has ``mesh_model_config``'s)."""
    source = tensors if isinstance(tensors, TensorSource) else ArraySource(tensors)
    if cfg.is_moe:
        source = ExpertTensors.for_model(source, cfg)
    mesh = mesh_or_first_device(mesh)
    if model_kwargs.get("expert_parallel"):
        check_expert_parallel(cfg, mesh_size(mesh))
    located, unexpected = locate_tensors(source, cfg, kv_head_repeats(cfg, mesh_size(mesh)))
    cfg = mesh_model_config(cfg, mesh_size(mesh))
    graphdef, state = abstract_model(cfg, dtype, model_kwargs)
    flat = nnx.to_flat_state(state)
    check_tensors(located, unexpected, source, flat, cfg)
    for (path, var), sharding in zip(flat, flat_param_shardings(state, mesh)):
        read = functools.partial(read_param, source, located, path, dtype=param_dtype(path, var, dtype), cfg=cfg)
        var.set_value(place(read, tuple(var.shape), sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------- safetensors folders
# float8 tensors, which safetensors reads into no framework here: mapped from the file directly
_FLOAT8 = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


class SafetensorsSource(contextlib.AbstractContextManager):
    """The tensors of safetensors files, each file opened once (memory-mapped): a slice reads only
    its own bytes. Which file holds a tensor comes from the files' headers. numpy has no
    bfloat16, so a file holding bfloat16 tensors (most checkpoints) is read through JAX's view
    of it and handed on as an ml_dtypes array; float8 tensors (FP8 checkpoints) are mapped from
    the file as ml_dtypes arrays, at the offsets its header gives."""

    def __init__(self, files: Iterable[str | os.PathLike]) -> None:
        from safetensors import safe_open

        self._files = contextlib.ExitStack()
        self._handles, self._float8 = {}, {}
        for file in files:
            with _reading_safetensors(file):
                handle = self._files.enter_context(safe_open(file, framework="numpy"))
                dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
                if "BF16" in dtypes.values():
                    handle = self._files.enter_context(safe_open(file, framework="flax"))
            self._handles.update(dict.fromkeys(handle.keys(), handle))
            if any(d in _FLOAT8 for d in dtypes.values()):
                self._float8.update(_float8_tensors(file, dtypes))

    def names(self) -> Iterable[str]:
        return self._handles.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str, index: Index) -> np.ndarray:
        if name in self._float8:
            return np.array(self._float8[name][index])
        return np.asarray(self._handles[name].get_slice(name)[index])

    def __exit__(self, *exc) -> None:
        self._files.close()


def _float8_tensors(file, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
    """The float8 tensors of a safetensors file as read-only memory maps."""
    length, header = safetensors_header(file)
    data = np.memmap(file, np.uint8, mode="r", offset=8 + length)
    return {name: data[slice(*header[name]["data_offsets"])].view(_FLOAT8[d]).reshape(header[name]["shape"])
            for name, d in dtypes.items() if d in _FLOAT8}


@contextlib.contextmanager
def _reading_safetensors(file):
    """What the safetensors library raises about ``file``, as an error naming it and what is
    wrong with it (the library's error chained)."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        raise CheckpointFileError(file, _framing_problem(file) or f"corrupt safetensors file ({error})") from error
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{file}: no such safetensors file") from error


def _framing_problem(file) -> str | None:
    """What is wrong with a safetensors file's framing (an 8-byte little-endian header length, the
    JSON header, then the tensor data up to the largest end offset the header gives, the file's
    end), None if it holds together."""
    size = os.path.getsize(file)
    corrupt = "truncated or corrupt safetensors file"
    if size < 8:
        return f"{corrupt} (file has {size} bytes, fewer than the 8 of the header's length)"
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if 8 + length > size:
            return f"{corrupt} (header length says at least {8 + length} bytes, file has {size})"
        raw = f.read(length)
    try:
        header = json.loads(raw)
        end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                  default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"corrupt safetensors file (its {length}-byte header is not a safetensors header: {error})"
    if 8 + length + end != size:
        return f"{corrupt} (header says {8 + length + end} bytes, file has {size})"
    return None


def safetensors_header(file) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, read directly; CheckpointFileError naming the
    file when its framing does not hold together."""
    if (problem := _framing_problem(file)) is not None:
        raise CheckpointFileError(file, problem)
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return length, json.loads(f.read(length))


# transformers' shard names: model-00001-of-00004.safetensors
_SHARD = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


def safetensors_files(folder: str | os.PathLike) -> tuple[ModelConfig, list[Path]]:
    """``config.json`` + one or many ``*.safetensors`` shards (``model.safetensors.index.json``).
    (A ``quantization_config`` there: ``quantization_config``.) A missing folder, config or shard
    is a FileNotFoundError naming it; an unreadable config or index a CheckpointFileError."""
    from transformers import AutoConfig

    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"{folder}: no such file or folder; --model must be a Hugging Face checkpoint folder "
                                f"or a .gguf file")
    config = folder / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{folder}: no config.json; --model must be a Hugging Face checkpoint folder or a .gguf file")
    check_config_fields(read_json_object(config), str(config))
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as error:      # transformers raises ValueError, KeyError, TypeError, its own validation errors
        raise CheckpointFileError(config, f"not a model config transformers reads ({error})") from error
    cfg = ModelConfig.from_hf(hf_config)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFileError(index, "no weight_map (tensor name -> shard file) in it")
        files = sorted(set(map(str, weight_map.values())))
        if missing := [name for name in files if not (folder / name).is_file()]:
            raise FileNotFoundError(f"{folder / missing[0]}: no such file; {index.name} names it "
                                    f"({len(missing)} of its {len(files)} shards missing: {missing})")
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        _check_shard_numbers(folder, files)
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return cfg, [folder / name for name in files]


def _check_shard_numbers(folder: Path, files: list[str]) -> None:
    """With no index, the shards named 1 to N of N must all be there."""
    for name in files:
        if m := _SHARD.fullmatch(name):
            prefix, width, total = m.group(1), len(m.group(2)), m.group(3)
            expected = [f"{prefix}-{i:0{width}d}-of-{total}.safetensors" for i in range(1, int(total) + 1)]
            if missing := [e for e in expected if e not in files]:
                raise FileNotFoundError(f"{folder / missing[0]}: no such file; {name} is one of {int(total)} shards "
                                        f"and there is no model.safetensors.index.json ({len(missing)} missing: "
                                        f"{missing})")


def quantization_config(folder: str | os.PathLike) -> dict | None:
    """config.json's ``quantization_config``: how a checkpoint stored quantized is stored."""
    return read_json_object(Path(folder) / "config.json").get("quantization_config") or None


def read_safetensors_folder(folder: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Every tensor of a checkpoint folder, read in full (``load_model`` reads lazily instead)."""
    from safetensors.numpy import load_file

    cfg, files = safetensors_files(folder)
    tensors = {}
    for file in files:
        with _reading_safetensors(file):
            tensors.update(load_file(file))
    return cfg, tensors


def load_model(path: str | os.PathLike, dtype=jnp.float32, *, mesh=None, quantization: str | None = None,
               **model_kwargs):
    """A checkpoint folder or a .gguf file -> (model, config); with a ``mesh``, the model and
    config as the mesh runs them (``build_model``). ``quantization``: None keeps the weights as
    stored (a GGUF's quantized blocks kept quantized where the engine has their layout,
    ``models.gguf``); ``int8`` / ``int4`` quantize an unquantized checkpoint's projections and
    embedding while it loads; ``none`` dequantises a GGUF or a checkpoint stored quantized
    (``quantization_config``: FP8, compressed-tensors, AWQ, GPTQ; ``models.stored_quantization``)
    to ``dtype``. Projections kept int8 / int4 are laid out for the CPU kernel where it reads them
    (``models.quantization.tile_for_cpu``), float32 ones too (``models.panels``)."""
    path = Path(path)
    if quantization not in (None, "none", *SCHEMES):
        raise ValueError(f"quantization: {quantization!r} is not supported (supported: {[*SCHEMES, 'none']})")
    if path.suffix == ".gguf":
        if quantization in SCHEMES:
            raise ValueError(f"quantization: {quantization!r} quantizes an unquantized checkpoint; a GGUF file "
                             "is served in its own quantization (or dequantised with 'none')")
        model, _ = load_gguf(path, dtype, mesh=mesh, keep_quantized=quantization != "none", **model_kwargs)
    else:
        cfg, files = safetensors_files(path)
        split = mesh_size(mesh_or_first_device(mesh))
        stored = quantization_config(path)
        with SafetensorsSource(files) as source:
            if stored:
                if quantization in SCHEMES:
                    raise ValueError(f"quantization: {quantization!r} quantizes an unquantized checkpoint; {path} is "
                                     f"stored quantized (quantization_config.quant_method "
                                     f"{stored.get('quant_method')!r}) and is served so (or dequantised with 'none')")
                weights = stored_weights(source, stored)
                if quantization != "none":
                    cfg = cfg.replace(quantization=stored_plan(weights, cfg, split))
                source = StoredQuantizationSource(source, weights, cfg, dequantize=quantization == "none")
                cfg = cfg.replace(kv_scales=any(KV_SCALE.fullmatch(name) for name in source.names()))
            elif quantization in SCHEMES:
                cfg = cfg.replace(quantization=online_plan(cfg, quantization, split))
                # a mixture's experts quantized as stacks: one set of names whatever the file holds
                source = QuantizingSource(ExpertTensors.for_model(source, cfg) if cfg.is_moe else source, cfg)
            model = build_model(cfg, source, dtype, mesh=mesh, **model_kwargs)
    tile_for_cpu(model, dtype, mesh_size(mesh_or_first_device(mesh)))
    panel_for_cpu(model, dtype, mesh_size(mesh_or_first_device(mesh)))
    return model, model.config



# ---------------------------------------------------------------- checkpoint dtype
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(path: str | os.PathLike) -> str | None:
    """The dtype the checkpoint stores its weights in, without loading them: ``torch_dtype`` /
    ``dtype`` of config.json, else the first safetensors shard's most common tensor dtype; for a
    GGUF, ``float32`` / ``float16`` if all tensors are, else ``quantized``. None if unknown."""
    path = Path(path)
    if path.suffix == ".gguf":
        return gguf_dtype(path)
    config = read_json_object(path / "config.json") if (path / "config.json").exists() else {}
    if isinstance(named := config.get("torch_dtype") or config.get("dtype"), str):
        return named
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        return None
    _, header = safetensors_header(shards[0])
    counts = collections.Counter(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return _SAFETENSORS_DTYPES.get(counts.most_common(1)[0][0]) if counts else None


def load_mtp(path: str | os.PathLike, model, model_config: ModelConfig, dtype, *, mesh=None,
             quantization: str | None = None, **model_kwargs):
    """The first multi-token prediction layer of the checkpoint folder ``path`` (the model's own),
    sharing ``model``'s embedding and LM head -> (the head, its ``MTPConfig``); a checkpoint
    without its tensors is an error saying so. (The layer is read in ``dtype`` whatever the
    model's ``quantization``, a checkpoint stored quantized dequantised: it is one layer.)"""
    cfg = mtp_config(model_config)
    _, files = safetensors_files(path)
    stored = quantization_config(path)
    with SafetensorsSource(files) as source:
        tensors = MTPTensors(source, model_config.num_layers)
        if not any(name.endswith(".eh_proj.weight") for name in tensors.names()):
            raise ValueError(f"speculative_config.method: 'mtp': {path} holds no tensors of a multi-token prediction "
                             f"layer (model.layers.{model_config.num_layers}.eh_proj.weight and the rest)")
        if stored:
            tensors = StoredQuantizationSource(tensors, stored_weights(tensors, stored), cfg.layer, dequantize=True)
        head = build_model(cfg.layer, tensors, dtype, mesh=mesh, **model_kwargs)
    head.share_embeddings(model)
    return head, cfg
