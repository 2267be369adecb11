"""LoRA on the device: the model's adapter slots and the grouped delta of a step's rows.

Adapters live in fixed slots beside each target projection (``LoRAWeights``: ``max_loras`` x
``max_rank``, zero-padded, split over the mesh like the projection), so loading one writes a
slot and never changes a shape. A step's token rows come grouped by slot (``lora_rows``, on the
host); each target projection adds ``lora_delta``: the rows in slot order through two grouped
matmuls, shrink then expand, so each row meets its own adapter only. ``models.lora`` reads the
adapters these slots take.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import grouped_dense
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import MLP, M, _sharded


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(D_in, D_out) of each projection LoRA may adapt."""
    d, q, kv, f = (config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                   config.intermediate_size)
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def lora_rows(slots: np.ndarray, num_slots: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's token rows grouped by adapter (host-side, once per step): (order [num_tokens], the
    rows sorted by slot with the base rows (-1) and the padding last; group_sizes [num_slots]).
    ``slots``: each real token's slot (fewer than ``num_tokens``: the rest is padding)."""
    group = np.full(num_tokens, num_slots, np.int64)
    group[:len(slots)] = np.where(slots < 0, num_slots, slots)
    order = np.argsort(group, kind="stable").astype(np.int32)
    sizes = np.bincount(group, minlength=num_slots + 1)[:num_slots].astype(np.int32)
    return order, sizes


def lora_delta(x: jax.Array, order: jax.Array, sizes: jax.Array, a: jax.Array, b: jax.Array,
               layer: jax.Array | None = None, grouped_fn: Callable = grouped_dense) -> jax.Array:
    """The LoRA delta of each row: ``x[t] @ a[s] @ b[s]`` for its slot ``s``, zero for a base row.
    x: [T, D_in]; (order, sizes): ``lora_rows``; a: [S, D_in, R], b: [S, R, D_out] (or stacked
    [L, ...] with ``layer``) -> [T, D_out].

    Each row meets its own adapter only: the rows in slot order go through two grouped matmuls,
    shrink then expand (``ragged_dot``, or OpenBLAS on a CPU); rows past the groups (the base
    model's and the padding) come out zero."""
    shrunk = grouped_fn(x[order], a, sizes, layer)                 # [T, R]
    expanded = grouped_fn(shrunk, b, sizes, layer)                 # [T, D_out]
    return jnp.zeros_like(expanded).at[order].set(expanded)


class LoRAWeights(nnx.Module):
    """The device slots of one layer kind's target projections (attention's or the MLP's): per
    module, ``<module>_a`` [L, S, D_in, R] and ``<module>_b`` [L, S, R, D_out], zero until an
    adapter is written into a slot. Split over the mesh like the projection they adapt: a
    column-split one (q/k/v, gate/up) splits B's output, a row-split one (o, down) A's input."""

    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int, max_rank: int,
                 dtype) -> None:
        for module, (d_in, d_out) in shapes.items():
            rows = module in ROW_SPLIT
            setattr(self, f"{module}_a", _sharded(jnp.zeros((num_layers, max_loras, d_in, max_rank), dtype),
                                                  (None, None, M if rows else None, None)))
            setattr(self, f"{module}_b", _sharded(jnp.zeros((num_layers, max_loras, max_rank, d_out), dtype),
                                                  (None, None, None, None if rows else M)))
        self.targets = tuple(shapes)
        self.grouped_fn = grouped_dense         # XLA's ragged_dot over a mesh (models.mesh.shard_kernels)

    def delta(self, module: str, x: jax.Array, md: AttentionMetadata, layer: jax.Array | None) -> jax.Array:
        """x [T, D_in] -> each row's adapter's delta for ``module`` [T, D_out]."""
        a, b = getattr(self, f"{module}_a")[...], getattr(self, f"{module}_b")[...]
        return lora_delta(x, md.lora_order, md.lora_sizes, a, b, layer, self.grouped_fn)


ROW_SPLIT = frozenset({"o_proj", "down_proj"})       # split by their input under tensor parallelism
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def attach_lora(model, max_loras: int, max_rank: int, dtype) -> tuple[str, ...]:
    """Give ``model``'s layers LoRA slots (``LoRAWeights``) beside their target projections: every
    attention projection, and the MLP's where the layers' MLP is dense (a mixture of experts'
    experts take no adapter). -> the target modules served."""
    cfg = model.config
    shapes = module_shapes(cfg)
    layers = model.layers
    layers.self_attn.lora = LoRAWeights({m: shapes[m] for m in ATTENTION_TARGETS}, cfg.num_layers, max_loras,
                                        max_rank, dtype)
    targets = ATTENTION_TARGETS
    if isinstance(getattr(layers, "mlp", None), MLP):
        layers.mlp.lora = LoRAWeights({m: shapes[m] for m in MLP_TARGETS}, cfg.num_layers, max_loras, max_rank,
                                      dtype)
        targets += MLP_TARGETS
    return targets
