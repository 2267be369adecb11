"""Tensor parallelism as layout: the device mesh, where each array lives on it, and the paged
attention kernels run per shard.

The model's parameters say how they split (partition metadata over the ``model`` axis, beside
the layers that own them); here those names become ``NamedSharding``s on a ``Mesh``, and XLA's
SPMD partitioner inserts the collectives (an all-reduce after each row-split projection, a
gather of the vocabulary-split logits for the sampler). The paged KV cache splits on its
KV-head axis. A Pallas kernel is opaque to the partitioner, so the attention and the KV write
run inside ``shard_map``: each device attends with its own query heads over its own KV heads.

When there are fewer KV heads than devices, each KV head is repeated so that every device holds
the head its query heads read: with K heads on ``tp`` devices, head j becomes heads
j*r .. j*r + r - 1 (r = tp / K). Query head n read head n // (N/K); on the mesh it reads head
n // (N/tp), which is a copy of the same one, so the model computes exactly the same thing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxengine.models.config import ModelConfig
from jaxengine.kernels.matmul import xla_dense, xla_grouped_dense
from jaxengine.kernels.matmul.quantized import QuantizedWeight
from jaxengine.kernels.paged_attention.layout import heads_together
from jaxengine.models.latent_attention import LatentAttention
from jaxengine.models.layers import MODEL_AXIS, attention_modules, dense_modules
from jaxengine.models.lora_weights import LoRAWeights
from jaxengine.models.moe import Experts, expert_of_rows, grouped_swiglu, routed_swiglu

logger = logging.getLogger(__name__)

# KV caches (k, v), each [L, P, S, K*H] (heads one after another): split by heads.
KV_CACHE_SPEC = P(None, None, None, MODEL_AXIS)
_HEADS = P(None, MODEL_AXIS, None)           # q, k, v, attention output: [T, heads, H]
_LAYER_CACHE_MERGED = P(None, None, MODEL_AXIS)  # one layer's cache, heads merged: [P, S, K*H]


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis mesh (``model``) over ``devices``: tensor parallelism of ``len(devices)``."""
    return Mesh(np.asarray(devices), (MODEL_AXIS,))


def mesh_or_first_device(mesh: Mesh | None) -> Mesh:
    """``mesh``, or a one-device mesh on the first device when there is none."""
    return mesh if mesh is not None else make_mesh(jax.devices()[:1])


def replica_devices(tensor_parallel_size: int, replica: int = 0) -> list[jax.Device]:
    """The devices of data-parallel replica ``replica``: the next ``tensor_parallel_size`` of them."""
    devices = jax.devices()
    first, last = replica * tensor_parallel_size, (replica + 1) * tensor_parallel_size
    if last > len(devices):
        raise ValueError(f"tensor_parallel_size: {last} devices needed, {len(devices)} available{_hint(devices)}")
    return devices[first:last]


def check_replica_devices(tensor_parallel_size: int, data_parallel_size: int) -> None:
    """ValueError naming ``data_parallel_size`` when its replicas need more devices than there are."""
    devices, needed = jax.devices(), tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(f"data_parallel_size: {data_parallel_size} replicas of {tensor_parallel_size} device(s) "
                         f"need {needed} devices, {len(devices)} available{_hint(devices)}")


def _hint(devices: list[jax.Device]) -> str:
    return (" (on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices)"
            if devices[0].platform == "cpu" else "")


def mesh_size(mesh: Mesh) -> int:
    return mesh.shape[MODEL_AXIS]


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming ``tensor_parallel_size`` when the model's heads cannot be split ``tp`` ways."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"the {cfg.num_heads} attention heads")
    k = cfg.num_kv_heads
    if (k % tp if k >= tp else tp % k):
        problems.append(f"the {k} KV heads (their count must divide it or be a multiple of it)")
    if problems:
        raise ValueError(f"tensor_parallel_size: {tp} does not split {' and '.join(problems)} of "
                         f"{cfg.architecture}")


def kv_head_repeats(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head the mesh holds (1 unless there are fewer heads than devices)."""
    check_tensor_parallel(cfg, tp)
    return max(1, tp // cfg.num_kv_heads)


def mesh_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model as a mesh of ``tp`` devices runs it: its KV heads repeated as needed."""
    return cfg.replace(num_kv_heads=cfg.num_kv_heads * kv_head_repeats(cfg, tp))


def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int:
    """KV heads in each device's share of the cache (what a KV block costs there)."""
    return mesh_model_config(cfg, tp).num_kv_heads // tp


def kv_elements_per_device(cfg: ModelConfig, tp: int, grouped: bool = True) -> int:
    """Numbers one token's place in a block costs each device, over the layers a block holds
    (``ModelConfig.kv_group_size``: all of them, unless the layers keep memory in groups): its
    share of the KV heads, or latent attention's whole cache (replicated: every device's heads
    read every latent). Without ``grouped``: all the layers (a draft model's cache)."""
    if cfg.is_mla:
        return cfg.kv_elements_per_token
    return kv_heads_per_device(cfg, tp) * 2 * cfg.head_dim * (cfg.kv_group_size if grouped else cfg.num_kv_layers)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_cache_sharding(mesh: Mesh, cfg: ModelConfig | None = None, layer_axis: bool = True) -> NamedSharding:
    """The KV caches' sharding: split by KV heads, or for ``cfg``'s latent attention replicated
    (one latent per token serves every head: each device reads them all for its own heads).
    ``layer_axis``: [L, P, S, K*H]; else a one-layer head's [P, S, K*H]."""
    if cfg is not None and cfg.is_mla:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, KV_CACHE_SPEC if layer_axis else _LAYER_CACHE_MERGED)


def cache_shardings(mesh: Mesh, cfg: ModelConfig | None = None):
    """The shardings of a step's caches: ``kv_cache_sharding``'s for the KV arrays, and for a
    hybrid model's recurrent state pools after them (``models.qwen3_5``) replicated, as the
    recurrent layers' weights are."""
    kv = kv_cache_sharding(mesh, cfg)
    if cfg is None or not cfg.is_hybrid:
        return kv
    return (kv,) * len(cfg.kv_cache_parts) + (NamedSharding(mesh, P()),) * len(cfg.state_slot_sizes())


def param_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """Each parameter's ``NamedSharding`` from its partition metadata. A dimension that does not
    divide by the mesh (a vocabulary of 50257 on 2 devices) is replicated instead of split."""
    specs = nnx.get_partition_spec(state)

    def sharding(spec, value) -> NamedSharding:
        spec = spec if isinstance(spec, P) else P()
        shape = value.shape
        fitted = [axis if axis is None or shape[i] % mesh.shape[axis] == 0 else None for i, axis in enumerate(spec)]
        if fitted != list(spec):
            logger.info("a parameter of shape %s does not split over %d devices: replicated", shape,
                        mesh.size)
        return NamedSharding(mesh, P(*fitted))

    return jax.tree.map(sharding, specs, state, is_leaf=lambda x: isinstance(x, P))


def flat_param_shardings(state: nnx.State, mesh: Mesh) -> list[NamedSharding]:
    """``param_shardings`` as a list, in the order of ``nnx.to_flat_state(state)``."""
    return [s.get_value() if hasattr(s, "get_value") else s
            for _, s in nnx.to_flat_state(param_shardings(state, mesh))]


def place_model(model: nnx.Module, mesh: Mesh) -> None:
    """Move a model's parameters to their shardings on ``mesh`` (for a model built in memory;
    checkpoints load straight into their shardings)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh)))


# ---------------------------------------------------------------- kernels per shard
class ShardedAttention:
    """``attention_fn(q, k_cache, v_cache, md, **kw)`` run per device on its heads, over its KV
    heads' part of the caches, or (``replicated_cache``: latent attention's) over all of them."""

    def __init__(self, attention_fn: Callable, mesh: Mesh, replicated_cache: bool = False) -> None:
        self.inner, self.mesh = attention_fn, mesh
        self.cache_spec = P() if replicated_cache else _LAYER_CACHE_MERGED
        self.__name__ = f"sharded {getattr(attention_fn, '__name__', type(attention_fn).__name__)}"

    def __call__(self, q, k_cache, v_cache, md, *, sinks=None, **kw):
        """``sinks`` [N] (per query head) split as the query heads are."""

        def per_device(q, k, v, md, sinks=None):
            return self.inner(q, k, v, md, sinks=sinks, **kw) if sinks is not None else self.inner(q, k, v, md, **kw)

        specs = (_HEADS, self.cache_spec, self.cache_spec, P()) + (() if sinks is None else (P(MODEL_AXIS),))
        fn = jax.shard_map(per_device, mesh=self.mesh, in_specs=specs, out_specs=_HEADS,
                           check_vma=False)      # Pallas calls inside shard_map need it off
        return fn(q, *map(heads_together, (k_cache, v_cache)), md, *(() if sinks is None else (sinks,)))


class ShardedKVWrite:
    """``kv_write_fn(k_cache, v_cache, k, v, slot_mapping)`` run per device on its KV heads."""

    def __init__(self, kv_write_fn: Callable, mesh: Mesh) -> None:
        self.inner, self.mesh = kv_write_fn, mesh
        self.__name__ = f"sharded {getattr(kv_write_fn, '__name__', type(kv_write_fn).__name__)}"

    def __call__(self, k_cache, v_cache, k, v, slot_mapping):
        def per_device(k_cache, v_cache, k, v, slot_mapping):
            return tuple(map(heads_together, self.inner(k_cache, v_cache, k, v, slot_mapping)))

        fn = jax.shard_map(per_device, mesh=self.mesh,
                           in_specs=(_LAYER_CACHE_MERGED, _LAYER_CACHE_MERGED, _HEADS, _HEADS, P()),
                           out_specs=(_LAYER_CACHE_MERGED, _LAYER_CACHE_MERGED), check_vma=False)
        out = fn(*map(heads_together, (k_cache, v_cache)), k, v, slot_mapping)
        return tuple(c.reshape(k_cache.shape) for c in out)


def stacked_of_one(*weights):
    """One layer's experts (arrays or ``QuantizedWeight``s) as stacks of one layer."""
    return [jax.tree.map(lambda a: a[None], w) for w in weights]


def leading(w):
    """The array whose leading axes are a weight's own: a quantized weight's values."""
    return w.q if isinstance(w, QuantizedWeight) else w


class ShardedExperts:
    """``routed_swiglu`` run per device over its share of the experts, the per-token sums added
    over the mesh (one all-reduce of [T, D], as after a dense MLP's row-split down projection).
    Every device holds the step's tokens and routing (both replicated). Tensor parallelism: each
    device has every expert's columns [F / n] and computes a partial sum for every pair.
    Expert parallelism: each device has E / n whole experts; the pairs sorted by expert put its
    experts' rows in one run, which it computes alone (the others' rows are zero there). Inside
    ``shard_map`` the grouped matmul sees plain per-device arrays, so the CPU kernel serves too."""

    def __init__(self, mesh: Mesh, expert_parallel: bool) -> None:
        self.mesh, self.expert_parallel = mesh, expert_parallel
        self.__name__ = f"{'expert' if expert_parallel else 'tensor'}-parallel experts"

    def __call__(self, x, weights, order, sizes, gate, up, down, layer, grouped_fn, *, activation,
                 gate_bias=None, up_bias=None):
        if layer is None:                                     # one layer's experts: a stack of one
            gate, up, down, layer = (*stacked_of_one(gate, up, down), jnp.int32(0))
        if self.expert_parallel:
            gate_up_spec = down_spec = P(None, MODEL_AXIS, None, None)
            bias_spec = P(MODEL_AXIS, None)
        else:
            gate_up_spec, down_spec = P(None, None, None, MODEL_AXIS), P(None, None, MODEL_AXIS, None)
            bias_spec = P(None, MODEL_AXIS)
        biases = () if gate_bias is None else (gate_bias, up_bias)

        def per_device(x, weights, order, sizes, gate, up, down, layer, *biases):
            first_row = 0
            if self.expert_parallel:
                local = leading(up).shape[-3]
                first = jax.lax.axis_index(MODEL_AXIS) * local
                first_row = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
                sizes = jax.lax.dynamic_slice(sizes, (first,), (local,))
            kw = dict(zip(("gate_bias", "up_bias"), biases))
            out = routed_swiglu(x, weights, order, sizes, gate, up, down, layer, grouped_fn, first_row,
                                activation=activation, **kw)
            return jax.lax.psum(out, MODEL_AXIS)

        fn = jax.shard_map(per_device, mesh=self.mesh,
                           in_specs=(P(), P(), P(), P(), gate_up_spec, gate_up_spec, down_spec, P(),
                                     *(bias_spec,) * len(biases)),
                           out_specs=P(), check_vma=False)
        return fn(x, weights, order, sizes, gate, up, down, layer, *biases)


class AllToAllExperts:
    """Expert parallelism by dispatch, the layout the engine measures against and does not use
    (docs/ARCHITECTURE.md, "Expert parallelism"): each device takes 1/N of the step's tokens,
    sends each of their token-expert pairs to the device holding its expert (one all-to-all),
    that device runs its experts' rows and sends the results back (a second all-to-all), the
    pairs are combined per token and the tokens gathered again (an all-gather). Shapes stay
    static, so each device's send buffer has room for all of its pairs on every device (no pair
    is ever dropped, at N times the bytes a ragged all-to-all would move). Same call as
    ``routed_swiglu``; the experts are split by ``E``."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.__name__ = "all-to-all expert-parallel experts"

    def __call__(self, x, weights, order, sizes, gate, up, down, layer, grouped_fn, *, activation,
                 gate_bias=None, up_bias=None):
        if layer is None:
            gate, up, down, layer = (*stacked_of_one(gate, up, down), jnp.int32(0))
        n, num_experts = mesh_size(self.mesh), sizes.shape[0]
        t, k = weights.shape
        pair_expert = _expert_of_pairs(order, sizes, t * k).reshape(t, k)     # num_experts: no expert
        pad = -t % n                                          # every device gets as many tokens
        x, weights = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(weights, ((0, pad), (0, 0)))
        pair_expert = jnp.pad(pair_expert, ((0, pad), (0, 0)), constant_values=num_experts)
        biases = () if gate_bias is None else (gate_bias, up_bias)
        expert_spec = P(None, MODEL_AXIS, None, None)

        def per_device(x, weights, pair_expert, gate, up, down, layer, *biases):
            rows_of = (t + pad) // n
            first = jax.lax.axis_index(MODEL_AXIS) * rows_of
            x, weights, pair_expert = (jax.lax.dynamic_slice_in_dim(a, first, rows_of) for a in (x, weights, pair_expert))
            local = leading(up).shape[-3]
            pe = pair_expert.reshape(-1)                                       # [Pd] this device's pairs
            dest = jnp.where(pe < num_experts, pe // local, n)                 # n: nowhere
            slot = jnp.cumsum(dest[:, None] == jnp.arange(n)[None, :], axis=0)[jnp.arange(pe.shape[0]),
                                                                               jnp.minimum(dest, n - 1)] - 1
            capacity = pe.shape[0]
            send = jnp.zeros((n + 1, capacity, x.shape[1]), x.dtype).at[dest, slot].set(x[jnp.arange(capacity) // k])
            send_expert = jnp.full((n + 1, capacity), local, jnp.int32).at[dest, slot].set(pe % local)
            rows = jax.lax.all_to_all(send[:n], MODEL_AXIS, 0, 0).reshape(n * capacity, -1)
            row_expert = jax.lax.all_to_all(send_expert[:n], MODEL_AXIS, 0, 0).reshape(-1)
            by_expert = jnp.argsort(row_expert, stable=True)
            local_sizes = jnp.zeros(local, jnp.int32).at[row_expert].add(1, mode="drop")
            kw = dict(zip(("gate_bias", "up_bias"), biases))
            done = grouped_swiglu(rows[by_expert], local_sizes, gate, up, down, layer, grouped_fn, activation, **kw)
            done = done[jnp.argsort(by_expert)].reshape(n, capacity, -1)
            back = jax.lax.all_to_all(done, MODEL_AXIS, 0, 0)                  # [n, capacity, D], as sent
            got = jnp.where((dest < n)[:, None], back[jnp.minimum(dest, n - 1), slot], 0)
            out = (got * weights.reshape(-1)[:, None].astype(x.dtype)).reshape(rows_of, k, -1).sum(axis=1)
            return jax.lax.all_gather(out, MODEL_AXIS, tiled=True)

        fn = jax.shard_map(per_device, mesh=self.mesh,
                           in_specs=(P(), P(), P(), expert_spec, expert_spec, expert_spec, P(),
                                     *(P(MODEL_AXIS, None),) * len(biases)),
                           out_specs=P(), check_vma=False)
        return fn(x, weights, pair_expert, gate, up, down, layer, *biases)[:t]


def _expert_of_pairs(order: jax.Array, sizes: jax.Array, num_pairs: int) -> jax.Array:
    """[T*k] each pair's expert, from its place in the expert order (E for pairs in no group)."""
    sorted_expert = jnp.where(jnp.arange(num_pairs) < sizes.sum(), expert_of_rows(sizes, num_pairs), sizes.shape[0])
    return jnp.zeros(num_pairs, jnp.int32).at[order].set(sorted_expert)


def check_expert_parallel(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming ``enable_expert_parallel`` when the experts cannot be split ``tp`` ways."""
    if not cfg.is_moe:
        raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts to split")
    if cfg.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: the {cfg.num_experts} experts of {cfg.architecture} do not "
                         f"split over {tp} devices (tensor_parallel_size)")


def shard_kernels(model: nnx.Module, mesh: Mesh) -> None:
    """Have every attention layer of ``model`` run its kernels per shard of ``mesh``; over more
    than one device the projections take XLA's dot, which the partitioner splits (a custom call
    would have its operands gathered whole on every device)."""
    if mesh.devices.size > 1:
        for module in dense_modules(model):
            module.dense_fn = xla_dense
        for slots in [node for _, node in nnx.iter_graph(model) if isinstance(node, LoRAWeights)]:
            slots.grouped_fn = xla_grouped_dense
        for experts in [node for _, node in nnx.iter_graph(model) if isinstance(node, Experts)]:
            if not isinstance(experts.experts_fn, ShardedExperts):
                experts.experts_fn = ShardedExperts(mesh, experts.expert_parallel)
    for attention in attention_modules(model):
        if not isinstance(attention.attention_fn, ShardedAttention):
            attention.attention_fn = ShardedAttention(attention.attention_fn, mesh)
        if not isinstance(attention.kv_write_fn, ShardedKVWrite):
            attention.kv_write_fn = ShardedKVWrite(attention.kv_write_fn, mesh)
    for latent in [node for _, node in nnx.iter_graph(model) if isinstance(node, LatentAttention)]:
        if not isinstance(latent.attention_fn, ShardedAttention):      # its cache is written by XLA's scatter
            latent.attention_fn = ShardedAttention(latent.attention_fn, mesh, replicated_cache=True)
