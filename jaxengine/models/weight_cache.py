"""The converted-weights cache: a checkpoint that must be converted before its tensors can be
placed (a GGUF is dequantised first) is saved once, with orbax, in our layout and with its config;
a later start skips the conversion and restores each device's shard straight into place."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxengine.models.config import GatedDeltaNetShape, Mamba2Shape, ModelConfig, RopeScaling, YarnScaling
from jaxengine.models.expert_tensors import ExpertTensors
from jaxengine.models.hf_tensors import KV_HEAD_AXIS, ArraySource, check_tensors, locate_tensors, read_param
from jaxengine.models.mesh import (flat_param_shardings, kv_head_repeats, mesh_model_config, mesh_or_first_device,
                                   mesh_size)
from jaxengine.paths import publish
from jaxengine.models.quantization import param_dtype
from jaxengine.models.registry import abstract_model


# In the cache folder, the folder ``weights``: the parameters as an orbax checkpoint (``params``), in
# our stacked layout, float32 (the parts of weights kept quantized in their own dtypes), KV heads as
# the checkpoint has them, and config.json. It is written elsewhere and moved into place whole, so a
# process restoring from it never sees a copy another process is still writing; of processes
# converting at once, the first to finish is kept. (The earlier formats' files, config.json with
# params or model.safetensors beside ``weights``, are removed; a ``weights`` whose config this
# version cannot use is replaced.)
_WEIGHTS, _PARAMS = "weights", "params"
_EARLIER = ("config.json", "model.safetensors", _PARAMS)


def cached_config(cached: Path) -> ModelConfig | None:
    """The config of the converted-weights cache folder's copy, else None."""
    if not (cached / _WEIGHTS / "config.json").exists():
        return None
    raw = json.loads((cached / _WEIGHTS / "config.json").read_text())
    # Written before weights could be kept quantized, or with bits where a format is named: rebuilt
    if "quantization" not in raw or any(isinstance(entry[1], int) for entry in raw["quantization"]):
        return None
    if raw.get("rope_scaling"):
        kind = YarnScaling if "beta_fast" in raw["rope_scaling"] else RopeScaling
        raw["rope_scaling"] = kind(**raw["rope_scaling"])
    for field in ("dense_layers", "full_attention_layers", "linear_attention_layers", "mixer_only_layers",
                  "mlp_only_layers"):                                        # JSON lists back to tuples
        if field in raw:
            raw[field] = tuple(raw[field])
    if raw.get("linear_attention"):
        shape = Mamba2Shape if "state_size" in raw["linear_attention"] else GatedDeltaNetShape
        raw["linear_attention"] = shape(**raw["linear_attention"])
    raw["quantization"] = tuple(tuple(entry) for entry in raw["quantization"])
    return ModelConfig(**raw)


def save_converted(cached: Path, cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    """HF-named tensors -> the cache folder, laid out as our parameters (checked as a load is)."""
    import orbax.checkpoint as ocp          # here: its import takes most of a second

    source = ArraySource(tensors)
    if cfg.is_moe:
        source = ExpertTensors.for_model(source, cfg)
    located, unexpected = locate_tensors(source, cfg)
    _, state = abstract_model(cfg, jnp.float32, {})
    flat = nnx.to_flat_state(state)
    check_tensors(located, unexpected, source, flat, cfg)
    params = {path: read_param(source, located, path, tuple(slice(0, n) for n in var.shape),
                               param_dtype(path, var, np.float32), cfg)
              for path, var in flat}
    cached.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached, prefix=f".{_WEIGHTS}-"))
    try:
        # this process alone writes its copy: no barrier with the other processes of a multi-host job
        only_me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                     active_processes={jax.process_index()})
        with ocp.StandardCheckpointer(multiprocessing_options=only_me) as checkpointer:
            checkpointer.save((tmp / _PARAMS).absolute(), traverse_util.unflatten_dict(params))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        while not publish(tmp, cached / _WEIGHTS) and cached_config(cached) is None:
            _set_aside(cached / _WEIGHTS)        # not another process's copy: one of an earlier format
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name in _EARLIER:
        if (cached / name).is_dir():
            shutil.rmtree(cached / name, ignore_errors=True)
        else:
            (cached / name).unlink(missing_ok=True)


def _set_aside(folder: Path) -> None:
    """Remove ``folder`` after moving it out of the way in one rename (another process may have
    done so first)."""
    aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".stale-"))
    try:
        os.rename(folder, aside / folder.name)
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def restore_converted(cached: Path, cfg: ModelConfig, dtype=jnp.float32, *, mesh=None, **model_kwargs):
    """The model from a converted-weights cache folder, each device's shard of each parameter read
    straight into place (orbax, with abstract arrays carrying the target shardings). KV heads
    fewer than devices are restored replicated, then repeated on the devices."""
    import orbax.checkpoint as ocp

    mesh = mesh_or_first_device(mesh)
    _, saved = abstract_model(cfg, dtype, {})
    target = {path: jax.ShapeDtypeStruct(var.shape, param_dtype(path, var, dtype), sharding=sharding)
              for (path, var), sharding in zip(nnx.to_flat_state(saved), flat_param_shardings(saved, mesh))}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = traverse_util.flatten_dict(
            checkpointer.restore((cached / _WEIGHTS / _PARAMS).absolute(), traverse_util.unflatten_dict(target)))
    repeats = kv_head_repeats(cfg, mesh_size(mesh))
    graphdef, state = abstract_model(mesh_model_config(cfg, mesh_size(mesh)), dtype, model_kwargs)
    flat = nnx.to_flat_state(state)
    for (path, var), sharding in zip(flat, flat_param_shardings(state, mesh)):
        value = restored[path]
        if repeats > 1 and path[-1] in KV_HEAD_AXIS:
            value = _repeat_heads(value, 1 + KV_HEAD_AXIS[path[-1]], repeats, sharding)
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _repeat_heads(w: jax.Array, axis: int, repeats: int, sharding) -> jax.Array:
    """Each head ``repeats`` times in a row, on the devices: each keeps only its own copy."""
    return jax.jit(functools.partial(jnp.repeat, repeats=repeats, axis=axis), out_shardings=sharding)(w)
