"""The converted-weights cache: a checkpoint that must be converted before its tensors can be
placed (a GGUF is dequantised first) is saved once, with orbax, in our layout and with its config;
a later start skips the conversion and restores each device's shard straight into place."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxengine.models.config import ModelConfig, RopeScaling, YarnScaling
from jaxengine.models.expert_tensors import ExpertTensors
from jaxengine.models.hf_tensors import KV_HEAD_AXIS, ArraySource, check_tensors, locate_tensors, read_param
from jaxengine.models.mesh import (flat_param_shardings, kv_head_repeats, mesh_model_config, mesh_or_first_device,
                                   mesh_size)
from jaxengine.models.quantization import param_dtype
from jaxengine.models.registry import abstract_model


# In the cache folder: the parameters as an orbax checkpoint, in our stacked layout, float32 (the
# parts of weights kept quantized in their own dtypes), KV heads as the checkpoint has them; config.json, written last, marks it complete. (A folder of
# the earlier format, model.safetensors, has no params: it is rebuilt.)
_PARAMS = "params"


def cached_config(cached: Path) -> ModelConfig | None:
    """The config of a complete converted-weights cache folder, else None."""
    if not ((cached / "config.json").exists() and (cached / _PARAMS).is_dir()):
        return None
    raw = json.loads((cached / "config.json").read_text())
    # Written before weights could be kept quantized, or with bits where a format is named: rebuilt
    if "quantization" not in raw or any(isinstance(entry[1], int) for entry in raw["quantization"]):
        return None
    if raw.get("rope_scaling"):
        kind = YarnScaling if "beta_fast" in raw["rope_scaling"] else RopeScaling
        raw["rope_scaling"] = kind(**raw["rope_scaling"])
    for field in ("dense_layers", "full_attention_layers"):          # JSON lists back to tuples
        if field in raw:
            raw[field] = tuple(raw[field])
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

    mesh = mesh_or_first_device(mesh)
    _, saved = abstract_model(cfg, dtype, {})
    target = {path: jax.ShapeDtypeStruct(var.shape, param_dtype(path, var, dtype), sharding=sharding)
              for (path, var), sharding in zip(nnx.to_flat_state(saved), flat_param_shardings(saved, mesh))}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = traverse_util.flatten_dict(
            checkpointer.restore((cached / _PARAMS).absolute(), traverse_util.unflatten_dict(target)))
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
