"""LoRA on the device: the model's adapter slots and the grouped delta of a step's rows.

Adapters live in fixed slots beside each target projection (``LoRAWeights``: ``max_loras`` x
``max_rank``, zero-padded, split over the mesh like the projection), so loading one writes a
slot and never changes a shape. A step's token rows come grouped by slot (``lora_rows``, on the
host); the target projections add ``lora_delta``: the rows in slot order through grouped
matmuls, one shrink for the projections that share an input, then an expand each, so each row
meets its own adapter only. ``models.lora`` reads the adapters these slots take.
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


def lora_rows(slots: np.ndarray, num_slots: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's token rows grouped by adapter (host-side, once per step): (order [num_tokens], the
    rows sorted by slot with the base rows (-1) and the padding last; group_sizes [num_slots];
    inverse [num_tokens], each row's place in that order). ``slots``: each real token's slot
    (fewer than ``num_tokens``: the rest is padding)."""
    group = np.full(num_tokens, num_slots, np.int64)
    group[:len(slots)] = np.where(slots < 0, num_slots, slots)
    order = np.argsort(group, kind="stable").astype(np.int32)
    sizes = np.bincount(group, minlength=num_slots + 1)[:num_slots].astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_tokens, dtype=np.int32)
    return order, sizes, inverse


def lora_delta(x: jax.Array, order: jax.Array, sizes: jax.Array, inverse: jax.Array, a: jax.Array,
               bs: tuple[jax.Array, ...], layer: jax.Array | None = None,
               grouped_fn: Callable = grouped_dense) -> tuple[jax.Array, ...]:
    """The LoRA deltas of each row for modules that share their input: ``x[t] @ a_m[s] @ b_m[s]``
    for its slot ``s``, zero for a base row. x: [T, D_in]; (order, sizes, inverse): ``lora_rows``;
    a: [S, D_in, M*R], the modules' A side by side; bs: each module's B [S, R, D_out] (or all
    stacked [L, ...] with ``layer``) -> each module's [T, D_out].

    Each row meets its own adapter only: the rows in slot order go through one grouped matmul
    that shrinks for every module at once, then one per module that expands (``ragged_dot``, or
    OpenBLAS on a CPU); rows past the groups (the base model's and the padding) come out zero.
    A step with no row on an adapter skips it all."""
    rank = bs[0].shape[-2]

    def deltas() -> tuple[jax.Array, ...]:
        shrunk = grouped_fn(x[order], a, sizes, layer)                                   # [T, M*R]
        return tuple(grouped_fn(shrunk[:, i * rank:(i + 1) * rank], b, sizes, layer)[inverse]
                     for i, b in enumerate(bs))

    def zeros() -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((x.shape[0], b.shape[-1]), x.dtype) for b in bs)

    return jax.lax.cond(jnp.any(sizes > 0), deltas, zeros)


# The target projections by the input they share: one shrink serves each group.
INPUT_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}
ROW_SPLIT = frozenset({"o_proj", "down_proj"})       # split by their input under tensor parallelism


class LoRAWeights(nnx.Module):
    """The device slots of one layer kind's target projections (attention's or the MLP's), zero
    until an adapter is written into a slot: per group of projections sharing an input
    (``INPUT_GROUPS``), ``a_<group>`` [L, S, D_in, M*R] (the group's M modules' A side by side),
    and per module ``b_<module>`` [L, S, R, D_out]. Split over the mesh like the projections they
    adapt: a column-split one (q/k/v, gate/up) splits B's output (its A, of the unsplit input, is
    whole on every device), a row-split one (o, down) A's input."""

    def __init__(self, groups: tuple[str, ...], shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int,
                 max_rank: int, dtype) -> None:
        for group in groups:
            modules = INPUT_GROUPS[group]
            d_in = shapes[modules[0]][0]
            rows = modules[0] in ROW_SPLIT
            setattr(self, f"a_{group}", _sharded(jnp.zeros((num_layers, max_loras, d_in, len(modules) * max_rank),
                                                           dtype), (None, None, M if rows else None, None)))
            for module in modules:
                setattr(self, f"b_{module}", _sharded(jnp.zeros((num_layers, max_loras, max_rank, shapes[module][1]),
                                                                dtype), (None, None, None, None if rows else M)))
        self.grouped_fn = grouped_dense         # XLA's ragged_dot over a mesh (models.mesh.shard_kernels)

    def deltas(self, group: str, x: jax.Array, md: AttentionMetadata, layer: jax.Array | None) -> tuple[jax.Array, ...]:
        """x [T, D_in] -> each row's adapter's delta [T, D_out] for each module of ``group``."""
        bs = tuple(getattr(self, f"b_{m}")[...] for m in INPUT_GROUPS[group])
        return lora_delta(x, md.lora_order, md.lora_sizes, md.lora_inverse, getattr(self, f"a_{group}")[...], bs,
                          layer, self.grouped_fn)


def attach_lora(model, max_loras: int, max_rank: int, dtype) -> tuple[str, ...]:
    """Give ``model``'s layers LoRA slots (``LoRAWeights``) beside their target projections: every
    attention projection, and the MLP's where the layers' MLP is dense (a mixture of experts'
    experts take no adapter). -> the target modules served."""
    cfg = model.config
    if cfg.is_mla:
        raise ValueError(f"enable_lora: adapters on {cfg.architecture}'s latent attention are not supported")
    shapes = module_shapes(cfg)
    layers = model.layers
    layers.self_attn.lora = LoRAWeights(("qkv", "o"), shapes, cfg.num_layers, max_loras, max_rank, dtype)
    groups = ("qkv", "o")
    if isinstance(getattr(layers, "mlp", None), MLP):
        layers.mlp.lora = LoRAWeights(("gate_up", "down"), shapes, cfg.num_layers, max_loras, max_rank, dtype)
        groups += ("gate_up", "down")
    return tuple(m for g in groups for m in INPUT_GROUPS[g])
