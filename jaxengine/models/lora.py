"""LoRA adapters as data: PEFT checkpoints read into arrays that fit the model's slots.

A PEFT LoRA adapter adds to a projection of its target modules (``y = x @ W``, W: [D_in, D_out])
the low-rank delta ``scale * (x @ A) @ B`` with A: [D_in, r], B: [r, D_out] and
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). The scale is folded into B
when an adapter is read, and the rank is zero-padded to ``max_rank`` (a padded rank adds
nothing): the arrays fit a device slot (``models.lora_weights``) whatever the adapter's rank.
``lora_delta_reference`` is the per-row gather the grouped delta is tested against.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.config import ModelConfig
from jaxengine.models.lora_weights import module_shapes

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
DEFAULT_ALPHA = 8               # PEFT's lora_alpha when the config leaves it out
# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
TENSOR_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of a PEFT ``adapter_config.json`` that the delta depends on."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_folder(cls, folder: Path) -> "AdapterConfig":
        """Read and check ``adapter_config.json``; a ValueError names the file and the field."""
        path = folder / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
        except OSError:
            raise ValueError(f"{path}: no {CONFIG_FILE}: not a PEFT adapter folder") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if str(raw.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{path}: peft_type: only LORA adapters are served, got {raw['peft_type']!r}")
        r, alpha = raw.get("r"), raw.get("lora_alpha", DEFAULT_ALPHA)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"{path}: r: must be an integer >= 1, got {r!r}")
        for name in ("use_dora", "rank_pattern", "alpha_pattern"):      # a delta this module does not compute
            if raw.get(name):
                raise ValueError(f"{path}: {name}: not supported (plain LoRA only), got {raw[name]!r}")
        targets = raw.get("target_modules")
        targets = [targets] if isinstance(targets, str) else targets
        unknown = sorted(set(targets or ()) - set(TARGET_MODULES))
        if not targets or unknown:
            raise ValueError(f"{path}: target_modules: must be among {list(TARGET_MODULES)}, got {targets!r}")
        return cls(r, float(alpha), tuple(sorted(targets, key=TARGET_MODULES.index)), bool(raw.get("use_rslora")))


@dataclass
class LoRAAdapter:
    """An adapter read for a model: per target module, A [L, D_in, max_rank] and the scaled
    B [L, max_rank, D_out] (layers it does not adapt are zero); ``digest``: its weights' and
    config's content hash (the identity the prefix cache keys on, whatever its name)."""

    path: Path
    config: AdapterConfig
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    digest: str


def load_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA folder for ``model_config``; a ValueError names the file and the field
    (a missing file, rank above ``max_rank``, a tensor whose shape does not fit the model)."""
    from jaxengine.models.weights import SafetensorsSource

    folder = Path(path)
    config = AdapterConfig.from_folder(folder)
    if config.r > max_rank:
        raise ValueError(f"{folder / CONFIG_FILE}: r: {config.r} exceeds max_lora_rank={max_rank}")
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"{weights_path}: missing: a PEFT adapter saves its weights there")
    shapes, num_layers = module_shapes(model_config), model_config.num_layers
    weights = {m: (np.zeros((num_layers, shapes[m][0], max_rank), np.float32),
                   np.zeros((num_layers, max_rank, shapes[m][1]), np.float32)) for m in config.target_modules}
    with SafetensorsSource([weights_path]) as source:     # bfloat16 and float8 files too
        tensors = {name: np.asarray(source.read(name, slice(None)), np.float32) for name in source.names()}
    for name, value in sorted(tensors.items()):          # in name order: the first error is always the same
        match = TENSOR_NAME.search(name)
        if match is None:
            raise ValueError(f"{weights_path}: {name}: not a LoRA A or B of a projection this engine adapts")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in weights or layer >= num_layers:
            raise ValueError(f"{weights_path}: {name}: no such target in this model ({module}, layer {layer})")
        d_in, d_out = shapes[module]
        expected = (config.r, d_in) if which == "A" else (d_out, config.r)
        if value.shape != expected:
            hint = ""
            if module in ("k_proj", "v_proj") and which == "B" and value.shape[0] and d_out % value.shape[0] == 0:
                hint = (" (the mesh repeats the model's KV heads at this tensor_parallel_size: adapters of "
                        "k_proj / v_proj are served where the KV heads split evenly)")
            raise ValueError(f"{weights_path}: {name}: shape {list(value.shape)}, the model needs "
                             f"{list(expected)}{hint}")
        a, b = weights[module]
        if which == "A":
            a[layer, :, :config.r] = value.T
        else:
            b[layer, :config.r, :] = value.T * config.scale
    digest = hashlib.sha256(weights_path.read_bytes() + (folder / CONFIG_FILE).read_bytes()).hexdigest()
    return LoRAAdapter(folder, config, weights, digest)


def lora_delta_reference(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``lora_delta`` as a gather of each row's adapter (T x the adapter weights: tests only)."""
    safe = jnp.maximum(slots, 0)
    delta = jnp.einsum("tr,tro->to", jnp.einsum("td,tdr->tr", x, a[safe]), b[safe])
    return jnp.where((slots >= 0)[:, None], delta, 0.0)
