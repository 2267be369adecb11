"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): a router picks each token's top-k
experts, the token-expert pairs are sorted by expert, and each expert's SwiGLU runs as one grouped
matmul over its own rows (``kernels.matmul.grouped_dense``: ``ragged_dot``, or OpenBLAS on a CPU).
No expert runs on a token that did not choose it, and the padding rows of a bucket choose none.
Einsum letters as in ``models.layers``, plus E experts, F an expert's width and k the choices.

Tensor parallelism splits every expert by its width, as a dense MLP (gate/up by columns, down by
rows, an all-reduce after); expert parallelism gives each device whole experts instead. Either way
the router is replicated, every device routes every token, and each computes its part of every
token's output, summed over the devices (``models.mesh.ShardedExperts``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense, grouped_dense
from jaxengine.models.config import ModelConfig
from jaxengine.kernels.matmul.quantized import FORMATS, QuantizedWeight, dequantize, pack_int4, quantize
from jaxengine.models.layers import MLP, M, _param, _sharded, weight
from jaxengine.models.panels import plain
from jaxengine.models.quantization import online_plan


def route(logits: jax.Array, k: int, normalise: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] f32, experts [T, k] int32): softmax over every
    expert, the k largest, renormalised over the chosen ones when ``normalise``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def route_grouped(logits: jax.Array, k: int, normalise: bool, correction: jax.Array, num_groups: int,
                  top_groups: int, scaling: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router: logits [T, E] -> (weights [T, k] f32, experts [T, k] int32). Sigmoid
    scores; the choice adds ``correction`` [E] (a load-balancing bias, never in the weights) and
    keeps to the ``top_groups`` best of ``num_groups`` expert groups, each scored by the sum of its
    two best; the chosen experts' scores, renormalised when ``normalise``, times ``scaling``."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction.astype(jnp.float32)
    if num_groups > 1:
        grouped = choice.reshape(t, num_groups, e // num_groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)                     # [T, groups]
        kept = jax.lax.top_k(group_scores, top_groups)[1]
        group_mask = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(group_mask, e // num_groups, axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if normalise:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


def route_tokens(logits: jax.Array, cfg: ModelConfig, correction: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The routing ``cfg`` says: softmax top-k, or DeepSeek-V3's grouped sigmoid."""
    if cfg.scoring == "sigmoid":
        correction = jnp.zeros(cfg.num_experts) if correction is None else correction
        return route_grouped(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, correction, cfg.n_group,
                             cfg.topk_group, cfg.routed_scaling_factor)
    return route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)


def group_by_expert(experts: jax.Array, num_experts: int, num_valid: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """The token-expert pairs [T, k] in expert order: (order [T*k], the pairs' flat indices sorted
    by expert; group_sizes [E]). Pairs of tokens at or past ``num_valid`` (padding) sort last and
    belong to no group."""
    t, k = experts.shape
    padding = jnp.arange(t)[:, None] >= num_valid
    flat = jnp.where(padding, num_experts, experts).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1, mode="drop")    # the padding id drops
    return order, sizes


def expert_counts(experts: jax.Array, num_experts: int, num_valid: jax.Array | int) -> jax.Array:
    """[E] tokens routed to each expert this step (padding excluded)."""
    return group_by_expert(experts, num_experts, num_valid)[1]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's SwiGLU: the gate clamped above and the up projection both sides at ``limit``,
    gate * sigmoid(alpha * gate) * (up + 1). (A value, so that models built alike compare equal.)"""
    limit: float
    alpha: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)


def relu2(gate: None, up: jax.Array) -> jax.Array:
    """Nemotron-H's experts: relu(up)^2, no gate."""
    return jnp.square(jax.nn.relu(up))


def expert_activation(cfg: ModelConfig) -> Callable[[jax.Array | None, jax.Array], jax.Array]:
    if cfg.mlp_activation == "relu2":
        return relu2
    return swiglu if cfg.swiglu_limit is None else ClampedSwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha)


def routed_swiglu(x: jax.Array, weights: jax.Array, order: jax.Array, sizes: jax.Array, gate: jax.Array,
                  up: jax.Array, down: jax.Array, layer: jax.Array | None, grouped_fn: Callable = grouped_dense,
                  first_row: jax.Array | int = 0, *, gate_bias: jax.Array | None = None,
                  up_bias: jax.Array | None = None, activation: Callable = swiglu) -> jax.Array:
    """The experts' SwiGLU of the token-expert pairs in ``order``, weighted and summed per token:
    [T, D]. ``sizes`` are the groups of the experts in ``gate``/``up``/``down`` (all of them, or
    under expert parallelism one device's, whose pairs start at sorted row ``first_row``).
    ``gate_bias``/``up_bias`` [E, F]: per-expert biases of the same experts (gpt-oss); the down
    projection's bias is the caller's (it must not be summed over devices)."""
    t, k = weights.shape
    if not isinstance(first_row, int) or first_row:          # this device's groups first
        order = jnp.roll(order, -first_row)
    rows = x[order // k]                                       # [T*k, D], grouped by expert
    out = grouped_swiglu(rows, sizes, gate, up, down, layer, grouped_fn, activation, gate_bias, up_bias)
    out = out * weights.reshape(-1)[order][:, None].astype(x.dtype)
    unsorted = out[jnp.argsort(order)]                         # pair order again (others' rows: 0)
    return unsorted.reshape(t, k, -1).sum(axis=1)


def grouped_swiglu(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                   layer: jax.Array | None, grouped_fn: Callable, activation: Callable = swiglu,
                   gate_bias: jax.Array | None = None, up_bias: jax.Array | None = None) -> jax.Array:
    """Each expert's SwiGLU of its rows, the rows grouped by expert (``sizes``); rows past the
    groups (padding, other devices' experts) come out of the down projection as 0. Experts
    without a gate (``gate`` None) apply ``activation`` to up alone."""
    g = None if gate is None else grouped_fn(rows, gate, sizes, layer)
    u = grouped_fn(rows, up, sizes, layer)
    if gate_bias is not None:
        expert = expert_of_rows(sizes, rows.shape[0])
        g, u = g + gate_bias[expert], u + up_bias[expert]
    return grouped_fn(activation(g, u), down, sizes, layer)


def expert_of_rows(sizes: jax.Array, num_rows: int) -> jax.Array:
    """[num_rows] the group of each row of a grouped layout (rows past the groups: the last)."""
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(num_rows), side="right")
    return jnp.minimum(group, sizes.shape[0] - 1)


class Experts(nnx.Module):
    """E SwiGLU experts, stacked: gate/up [E, D, F], down [E, F, D] (gpt-oss: with biases [E, F]
    and [E, D], and the clamped SwiGLU). Over a mesh they are split by their width (tensor
    parallelism), or with ``expert_parallel`` by experts, each device holding E / devices whole
    ones (``models.mesh.ShardedExperts`` runs them per device). Kept quantized where
    ``cfg.quantization`` says (kinds ``experts.gate_proj`` and so on; ``models.quantization``)."""

    def __init__(self, cfg: ModelConfig, dtype, *, expert_parallel: bool = False, rngs: nnx.Rngs) -> None:
        e, d, f = cfg.num_experts, cfg.moe_latent_size or cfg.hidden_size, cfg.moe_intermediate_size
        gate_up, down = ((M, None, None), (M, None, None)) if expert_parallel else ((None, None, M), (None, M, None))
        self.gated = cfg.mlp_activation == "silu"       # Nemotron-H's experts have no gate
        if self.gated:
            self.gate_proj = weight(cfg, "experts.gate_proj", rngs, (e, d, f), dtype, gate_up)
        self.up_proj = weight(cfg, "experts.up_proj", rngs, (e, d, f), dtype, gate_up)
        self.down_proj = weight(cfg, "experts.down_proj", rngs, (e, f, d), dtype, down)
        if cfg.expert_bias:
            bias = (M, None) if expert_parallel else (None, M)
            self.gate_bias = _sharded(jnp.zeros((e, f), dtype), bias)
            self.up_bias = _sharded(jnp.zeros((e, f), dtype), bias)
            self.down_bias = _sharded(jnp.zeros((e, d), dtype), (None, None))     # added once, after the sum
        self.has_bias, self.num_experts = cfg.expert_bias, e
        self.activation = expert_activation(cfg)
        self.expert_parallel = expert_parallel
        self.grouped_fn = grouped_dense     # OpenBLAS on a CPU, XLA's ragged_dot elsewhere
        self.experts_fn = routed_swiglu     # per device over a mesh (models.mesh.shard_kernels)

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array, num_valid: jax.Array,
                 layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [T, D], the routing [T, k] -> (sum over each token's experts of weight * SwiGLU [T, D],
        the tokens routed to each expert [E])."""
        order, sizes = group_by_expert(experts, self.num_experts, num_valid)
        biases = dict(gate_bias=self.gate_bias[...], up_bias=self.up_bias[...]) if self.has_bias else {}
        gate = self.gate_proj[...] if self.gated else None
        out = self.experts_fn(x, weights, order, sizes, gate, self.up_proj[...], self.down_proj[...],
                              layer, self.grouped_fn, activation=self.activation, **biases)
        if self.has_bias:                  # sum over a token's experts of weight * down bias
            real = (jnp.arange(x.shape[0]) < num_valid)[:, None]
            mix = jnp.where(real, weights, 0).astype(x.dtype)
            out = out + jnp.einsum("tk,tkd->td", mix, self.down_bias[...][experts])
        return out, sizes


class SparseMoeBlock(nnx.Module):
    """Router (gpt-oss: with a bias; DeepSeek-V3: grouped sigmoid with a correction bias), routed
    experts and the shared expert (Qwen2-MoE: with its sigmoid gate; DeepSeek-V3: ungated)."""

    def __init__(self, cfg: ModelConfig, dtype, *, expert_parallel: bool = False, rngs: nnx.Rngs) -> None:
        # DeepSeek-V3 scores in float32, as its reference keeps its router (models.quantization)
        router_dtype = jnp.float32 if cfg.scoring == "sigmoid" else dtype
        self.router = _param(rngs, (cfg.hidden_size, cfg.num_experts), router_dtype, (None, None))
        if cfg.router_bias:
            self.router_bias = _sharded(jnp.zeros((cfg.num_experts,), dtype), (None,))
        if cfg.score_correction_bias:
            self.score_correction_bias = _sharded(jnp.zeros((cfg.num_experts,), jnp.float32), (None,))
        self.experts = Experts(cfg, dtype, expert_parallel=expert_parallel, rngs=rngs)
        if cfg.moe_latent_size:                   # Nemotron-H: the experts run in a narrower width
            self.latent_in = _param(rngs, (cfg.hidden_size, cfg.moe_latent_size), dtype, (None, None))
            self.latent_out = _param(rngs, (cfg.moe_latent_size, cfg.hidden_size), dtype, (None, None))
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, dtype, intermediate_size=cfg.shared_expert_intermediate_size, rngs=rngs)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = _param(rngs, (cfg.hidden_size, 1), dtype, (None, None))
        self.cfg = cfg
        self.dense_fn = dense

    def __call__(self, x: jax.Array, layer: jax.Array | None = None,
                 num_valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (the block's output [T, D], the tokens routed to each expert [E]); tokens at
        or past ``num_valid`` (padding) route nowhere."""
        cfg = self.cfg
        num_valid = x.shape[0] if num_valid is None else num_valid
        router = self.router[...]
        logits = self.dense_fn(x.astype(router.dtype), router, layer)
        if cfg.router_bias:
            logits = logits + self.router_bias[...]
        weights, experts = route_tokens(logits, cfg, self._correction(layer))
        if cfg.moe_latent_size:
            out, counts = self.experts(self.dense_fn(x, self.latent_in[...], layer), weights, experts, num_valid, layer)
            out = self.dense_fn(out, self.latent_out[...], layer)
        else:
            out, counts = self.experts(x, weights, experts, num_valid, layer)
        if cfg.shared_expert_intermediate_size:
            shared = self.shared_expert(x, layer)
            if cfg.shared_expert_gated:
                shared = jax.nn.sigmoid(self.dense_fn(x, self.shared_expert_gate[...], layer)) * shared
            out = out + shared
        return out, counts

    def _correction(self, layer: jax.Array | None) -> jax.Array | None:
        """The router's correction bias [E] (the layer's row of the stack), or None."""
        if not self.cfg.score_correction_bias:
            return None
        bias = self.score_correction_bias[...]
        return bias if layer is None or bias.ndim == 1 else bias[layer]


def with_quantized_experts(block: SparseMoeBlock, scheme: str, dtype=jnp.float32) -> SparseMoeBlock:
    """A copy of one layer's ``block`` with its routed experts quantized as ``--quantization
    scheme`` quantizes them while loading (the rest as it is): for measuring the layer alone."""
    plan = tuple(entry for entry in online_plan(block.cfg, scheme) if entry[0].startswith("experts."))
    cfg = block.cfg.replace(quantization=plan)
    copy = SparseMoeBlock(cfg, dtype, rngs=nnx.Rngs(0))
    projections = ("gate_proj", "up_proj", "down_proj") if block.experts.gated else ("up_proj", "down_proj")

    def kept(path, _) -> bool:                    # all but the experts' projections (biases too)
        return not (len(path) > 1 and path[-2] == "experts" and path[-1] in projections)
    nnx.update(copy, nnx.state(block, kept))
    for name in projections:
        fmt, group, offset = cfg.quant_spec(f"experts.{name}")
        values, scale, zero = quantize(np.asarray(getattr(block.experts, name)[...], np.float32), fmt, group,
                                       axis=1, offset=offset)
        target = getattr(copy.experts, name)
        target.q[...] = jnp.asarray(pack_int4(values, 1) if FORMATS[fmt].bits == 4 else values)
        target.scale[...] = jnp.asarray(scale)
        if zero is not None:
            target.offset[...] = jnp.asarray(zero)
    return copy


def dense_reference(block: SparseMoeBlock, x: jax.Array, layer: int | None = None) -> jax.Array:
    """The block computed densely: every expert on every token, weighted by a [T, E] matrix that is
    zero where a token did not choose the expert. The grouped path is checked against it."""
    cfg = block.cfg

    def pick(w):
        value = plain(w) if layer is None else jax.tree.map(lambda a: a[layer], plain(w))
        return dequantize(value, x.dtype) if isinstance(value, QuantizedWeight) else value
    logits = x @ pick(block.router) + (pick(block.router_bias) if cfg.router_bias else 0)
    weights, experts = route_tokens(logits, cfg, pick(block.score_correction_bias) if cfg.score_correction_bias else None)
    mix = jnp.zeros((x.shape[0], cfg.num_experts), jnp.float32)
    mix = mix.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)        # [T, E]
    e = block.experts
    xe = x @ pick(block.latent_in) if cfg.moe_latent_size else x
    g = jnp.einsum("td,edf->etf", xe, pick(e.gate_proj)) if e.gated else None
    u = jnp.einsum("td,edf->etf", xe, pick(e.up_proj))
    if cfg.expert_bias:
        g, u = g + pick(e.gate_bias)[:, None], u + pick(e.up_bias)[:, None]
    y = jnp.einsum("etf,efd->etd", expert_activation(cfg)(g, u), pick(e.down_proj))
    if cfg.expert_bias:
        y = y + pick(e.down_bias)[:, None]
    out = jnp.einsum("te,etd->td", mix.astype(x.dtype), y)
    if cfg.moe_latent_size:
        out = out @ pick(block.latent_out)
    if cfg.shared_expert_intermediate_size:
        s = block.shared_expert
        shared = ((jax.nn.silu(x @ pick(s.gate_proj)) * (x @ pick(s.up_proj))) if s.gated else
                  jnp.square(jax.nn.relu(x @ pick(s.up_proj)))) @ pick(s.down_proj)
        out = out + (jax.nn.sigmoid(x @ pick(block.shared_expert_gate)) if cfg.shared_expert_gated else 1) * shared
    return out
