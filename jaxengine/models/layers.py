"""The shared Llama-family layers (Flax NNX). Einsum letters: T tokens, N query heads, K KV heads,
H head size, D model width, F MLP width, V vocab.

Each parameter declares how tensor parallelism splits it, as partition metadata over the mesh
axis ``model`` (Megatron's layout): Q/K/V and the MLP's gate/up by heads or columns, the output
and down projections by rows (XLA all-reduces their partial sums), the embedding and LM head by
vocabulary; norms are replicated. Nothing here runs differently on one device or many."""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense, dense_each
from jaxengine.kernels.matmul.cpu_matmul import PanelWeight
from jaxengine.kernels.matmul.quantized import FP8_MAX, QuantizedWeight, TiledWeight
from jaxengine.kernels.paged_attention import AttentionMetadata, write_kv
from jaxengine.kernels.paged_attention.layout import FP8, is_fp8
from jaxengine.models.config import ModelConfig, YarnScaling
from jaxengine.models.hf_tensors import QUANTIZABLE
from jaxengine.models.quantization import PARTS, QuantizedParam

# (k, v), each [L, P, S, K*H]; a layer sees [P, S, K*H] (all layers flattened: [L*P, S, K*H]) and
# hands it to the KV write and the kernels as it is (``kernels.paged_attention.layout``). Latent
# attention's is one array, (pages,) (``models.latent_attention``).
KVCache = tuple[jax.Array, ...]


MODEL_AXIS = "model"        # the mesh axis tensor parallelism splits over
M = MODEL_AXIS


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, axes: tuple, std: float = 0.02) -> nnx.Param:
    """A random-initialised parameter split over the mesh as ``axes`` says (one name or None per dim)."""
    return _sharded(nnx.initializers.normal(std)(rngs.params(), shape, dtype), axes)


def weight(cfg: ModelConfig, kind: str, rngs: nnx.Rngs, shape: tuple[int, ...], dtype, axes: tuple):
    """A projection weight of ``kind``: a random-initialised parameter, or kept quantized where
    ``cfg.quantization`` says (``models.quantization``; read as ``w[...]`` either way)."""
    if (spec := cfg.quant_spec(kind)) is None:
        return _param(rngs, shape, dtype, axes)
    return QuantizedParam(shape, spec, QUANTIZABLE[kind], axes)


def _sharded(value: jax.Array, axes: tuple) -> nnx.Param:
    # Placement happens when the weights are loaded (models.weights), not at construction.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """``offset``: the scale is ``offset + weight`` (Qwen3.5's zero-centred norms: 1), in float32
    before the cast back, as that reference does; without one ``weight`` times the cast."""

    def __init__(self, dim: int, eps: float, dtype, offset: float = 0.0) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype) - offset)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)                     # normalise in f32, as the reference does
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return ((self.offset + self.weight[...].astype(jnp.float32)) * xf).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [R/2] of the R rotary dimensions (``cfg.rotary_dim``: the head's, unless
    RoPE is partial), with Llama 3 or YaRN scaling when configured (host-side constant)."""
    h = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    sc = cfg.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if isinstance(sc, YarnScaling):
        return _yarn_inv_freq(inv, cfg.rope_theta, h, sc).astype(np.float32)
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, base: float, dim: int, sc: YarnScaling) -> np.ndarray:
    """YaRN's blend: dimensions that turn fewer than ``beta_slow`` times over the original context
    are interpolated by ``factor``, those turning more than ``beta_fast`` times are kept, a
    linear ramp between (the dimension bounds rounded outwards when ``truncate``)."""
    def dimension(rotations: float) -> float:
        return dim * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(sc.beta_fast), dimension(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp                                     # 1: extrapolate (keep), 0: interpolate
    return inv / sc.factor * (1 - keep) + inv * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (1 otherwise)."""
    sc = cfg.rope_scaling
    if not isinstance(sc, YarnScaling):
        return 1.0
    if sc.attention_factor is not None:
        return float(sc.attention_factor)

    if sc.mscale and sc.mscale_all_dim:
        return yarn_mscale(sc.factor, sc.mscale) / yarn_mscale(sc.factor, sc.mscale_all_dim)
    return yarn_mscale(sc.factor)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times the original."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotate [T, n, H] by position; the half-split (rotate_half) layout of Hugging Face models;
    ``scale`` multiplies cos and sin (YaRN's attention factor). With fewer frequencies than H/2
    (partial RoPE) only the first 2 * len(inv_freq) dimensions turn; the rest pass as they are
    (none turn without frequencies: Nemotron-H's attention has no positions of its own)."""
    if inv_freq.shape[0] == 0:
        return x
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]      # [T, R/2]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    rotary = 2 * inv_freq.shape[0]
    x1, x2 = jnp.split(x[..., :rotary].astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if rotary == x.shape[-1] else jnp.concatenate([out, x[..., rotary:]], axis=-1)


FP8_KV = FP8                                 # the FP8 KV cache's values (--kv-cache-dtype fp8)


def to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale in float8_e4m3fn, clipped to its range (a cast past it gives NaN)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_KV)


def adapters(module: nnx.Module, md: AttentionMetadata | None):
    """The module's LoRA slots (``models.lora.LoRAWeights``) where it has them and the step carries
    its rows' adapters; else None (no adapter, or a step without them: a draft model's)."""
    if md is None or md.lora_order is None:
        return None
    return getattr(module, "lora", None)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, attention_fn: Callable, *, input_size: int | None = None,
                 rngs: nnx.Rngs) -> None:
        """``input_size``: the width q/k/v project from, when it is not the model's (an EAGLE-3
        head's takes the embedding and a hidden state side by side)."""
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d_in = input_size or d
        # With an output gate, each head's query then its gate ([.., n, 2H], as HF's rows lie)
        self.q_proj = weight(cfg, "q_proj", rngs, (d_in, n, 2 * h if cfg.attention_output_gate else h), dtype,
                             (None, M, None))
        self.k_proj = weight(cfg, "k_proj", rngs, (d_in, k, h), dtype, (None, M, None))
        self.v_proj = weight(cfg, "v_proj", rngs, (d_in, k, h), dtype, (None, M, None))
        self.o_proj = weight(cfg, "o_proj", rngs, (n, h, d), dtype, (M, None, None))
        if cfg.attention_bias:
            self.q_bias = _sharded(jnp.zeros((n, h), dtype), (M, None))
            self.k_bias = _sharded(jnp.zeros((k, h), dtype), (M, None))
            self.v_bias = _sharded(jnp.zeros((k, h), dtype), (M, None))
        if cfg.output_bias:
            self.o_bias = _sharded(jnp.zeros((d,), dtype), (None,))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, cfg.norm_offset)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        if cfg.attention_sinks:
            self.sinks = _sharded(jnp.zeros((n,), dtype), (M,))
        if cfg.kv_scales:                                  # an FP8 KV cache's scales, from the checkpoint
            self.k_scale = _sharded(jnp.ones((1,), dtype), (None,))
            self.v_scale = _sharded(jnp.ones((1,), dtype), (None,))
        self.cfg = cfg
        self.attention_fn = attention_fn
        self.kv_write_fn = write_kv       # the XLA scatter; kernels.paged_attention.kv_write has a Pallas one
        self.dense_fn = dense             # OpenBLAS on a CPU, XLA's dot elsewhere and on a mesh (models.mesh)

    def __call__(self, x: jax.Array, cache: KVCache, md: AttentionMetadata, inv_freq: np.ndarray,
                 layer: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """``layer``: the projections are stacked [L, ...] and this is layer ``layer`` of them."""
        cfg = self.cfg
        q, k, v = dense_each(self.dense_fn, x, (self.q_proj[...], self.k_proj[...], self.v_proj[...]),
                             layer)                               # [T, N, H], [T, K, H], [T, K, H]
        lora = adapters(self, md)
        if lora is not None:
            q, k, v = (p + d.reshape(p.shape) for p, d in zip((q, k, v), lora.deltas("qkv", x, md, layer)))
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        gate = None
        if cfg.attention_output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        scale = rope_attention_factor(cfg)
        q, k = apply_rope(q, md.positions, inv_freq, scale), apply_rope(k, md.positions, inv_freq, scale)
        kv_scales = self._kv_scales(cache[0].dtype)
        if kv_scales is not None:                                    # an FP8 cache holds k / k_scale, v / v_scale
            k, v = to_fp8(k, kv_scales[0]), to_fp8(v, kv_scales[1])
        cache = self.kv_write_fn(*cache, k, v, md.slot_mapping)     # writes precede the reads of this step
        o = self._attend(q, cache, md, layer, kv_scales)
        o_proj = self.o_proj[...]                                    # [(L,) N, H, D] -> [(L,) N*H, D]
        if not isinstance(o_proj, (QuantizedWeight, TiledWeight, PanelWeight)):   # (a quantized one contracts N, H itself)
            o_proj = o_proj.reshape(*o_proj.shape[:-3], -1, o_proj.shape[-1])
        if gate is not None:
            o = o * jax.nn.sigmoid(gate).astype(o.dtype)
        o = o.reshape(o.shape[0], -1)
        out = self.dense_fn(o, o_proj, layer)
        if lora is not None:
            out = out + lora.deltas("o", o, md, layer)[0]
        return (out + self.o_bias[...] if cfg.output_bias else out), cache

    def _kv_scales(self, cache_dtype) -> tuple[jax.Array, jax.Array] | None:
        """(k_scale, v_scale) of an FP8 cache (1.0 where the checkpoint has none), else None."""
        if not is_fp8(cache_dtype):
            return None
        if not self.cfg.kv_scales:
            return jnp.float32(1.0), jnp.float32(1.0)
        return self.k_scale[0].astype(jnp.float32), self.v_scale[0].astype(jnp.float32)

    def _attend(self, q: jax.Array, cache: KVCache, md: AttentionMetadata, layer: jax.Array | None,
                kv_scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """The attention kernel with this layer's window (and sinks). Where sliding and full layers
        alternate in one scan, the layer's kind picks one of two traced kernel calls (``lax.cond``).
        An FP8 cache's per-tensor scales leave the kernels: K's joins the softmax scale (q . k_scale
        k8 = (k_scale q) . k8), V's multiplies the output (sum p v_scale v8 = v_scale sum p v8)."""
        cfg = self.cfg
        kw = dict(scale=cfg.head_dim ** -0.5 * (1.0 if kv_scales is None else kv_scales[0]))
        if cfg.attention_sinks:
            kw["sinks"] = self.sinks[...]

        def attend(window: int | None) -> Callable:
            return lambda q, k, v: self.attention_fn(q, k, v, md, sliding_window=window, **kw)

        if not cfg.mixes_windows:
            out = attend(cfg.sliding_window)(q, *cache)
        elif layer is None:
            raise ValueError("a model whose layers mix sliding and full attention needs the layer index")
        else:
            is_full = jnp.asarray([i in cfg.full_attention_layers for i in range(cfg.num_layers)])
            out = jax.lax.cond(is_full[layer], attend(None), attend(cfg.sliding_window), q, *cache)
        return out if kv_scales is None else (out.astype(jnp.float32) * kv_scales[1]).astype(out.dtype)


class MLP(nnx.Module):
    """SwiGLU (gate, up, down); with ``cfg.mlp_activation`` "relu2" (Nemotron-H) relu(up)^2, no gate."""

    def __init__(self, cfg: ModelConfig, dtype, *, intermediate_size: int | None = None, rngs: nnx.Rngs) -> None:
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gated = cfg.mlp_activation == "silu"
        if self.gated:
            self.gate_proj = weight(cfg, "gate_proj", rngs, (d, f), dtype, (None, M))
        self.up_proj = weight(cfg, "up_proj", rngs, (d, f), dtype, (None, M))
        self.down_proj = weight(cfg, "down_proj", rngs, (f, d), dtype, (M, None))
        self.dense_fn = dense

    def __call__(self, x: jax.Array, layer: jax.Array | None = None, md: AttentionMetadata | None = None) -> jax.Array:
        """``md``: the step's metadata, whose LoRA grouping the adapters' deltas need (models.lora)."""
        if not self.gated:
            return self.dense_fn(jnp.square(jax.nn.relu(self.dense_fn(x, self.up_proj[...], layer))),
                                 self.down_proj[...], layer)
        lora = adapters(self, md)
        gate, up = dense_each(self.dense_fn, x, (self.gate_proj[...], self.up_proj[...]), layer)
        if lora is not None:
            gate_delta, up_delta = lora.deltas("gate_up", x, md, layer)
            gate, up = gate + gate_delta, up + up_delta
        h = jax.nn.silu(gate) * up
        out = self.dense_fn(h, self.down_proj[...], layer)
        return out if lora is None else out + lora.deltas("down", h, md, layer)[0]


class DecoderLayer(nnx.Module):
    """Attention and an MLP: a dense one, ``models.moe``'s mixture of experts (which takes the
    number of real tokens too, so that the padding routes nowhere), or none, when the model
    chooses each layer's MLP itself (``models.llama``, dense layers among sparse ones)."""

    def __init__(self, cfg: ModelConfig, dtype, attention_fn: Callable, mlp: nnx.Module | None, *,
                 attention: nnx.Module | None = None, rngs: nnx.Rngs) -> None:
        """``attention``: the layer's attention when it is not ``Attention`` (latent attention)."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attention if attention is not None else Attention(cfg, dtype, attention_fn, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if mlp is not None:
            self.mlp = mlp

    def attend(self, x: jax.Array, cache: KVCache, md: AttentionMetadata, inv_freq: np.ndarray,
               layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
        """The residual after attention, the MLP's input (normalised) and the cache."""
        attn, cache = self.self_attn(self.input_layernorm(x), cache, md, inv_freq, layer)
        x = x + attn
        return x, self.post_attention_layernorm(x), cache

    def __call__(self, x: jax.Array, cache: KVCache, md: AttentionMetadata, inv_freq: np.ndarray,
                 layer: jax.Array | None = None) -> tuple[jax.Array, KVCache, jax.Array]:
        """-> (the layer's output, the cache, tokens routed to each expert [E] (E = 0: a dense MLP))."""
        x, h, cache = self.attend(x, cache, md, inv_freq, layer)
        out, counts = run_mlp(self.mlp, h, layer, md, self.self_attn.cfg.num_experts)
        return x + out, cache, counts


def run_mlp(mlp: nnx.Module, h: jax.Array, layer: jax.Array | None, md: AttentionMetadata,
            num_experts: int) -> tuple[jax.Array, jax.Array]:
    """A dense MLP of ``h``, or a mixture of experts routing only the real tokens (the padding past
    ``md``'s last row goes nowhere); with the tokens routed to each of the ``num_experts`` [E]
    (none for a dense MLP)."""
    if isinstance(mlp, MLP):
        return mlp(h, layer, md), jnp.zeros(num_experts, jnp.int32)
    return mlp(h, layer, md.query_start_loc[-1])


# The projection weights of a layer: the layer scan leaves them stacked and passes the layer's
# index (``dense`` reads the stack in place), where slicing them per layer would copy them.
# A mixture of experts' router and expert stacks too (its expert weights are [L, E, ...]).
DENSE_WEIGHTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "router",
                           "shared_expert_gate", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj",
                           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "in_proj",
                           "latent_in", "latent_out"})


def is_dense_weight(path: tuple, value) -> bool:
    """A projection weight, a part of one kept quantized (``(..., "q_proj", "scale")``), or a LoRA
    slot stack (``(..., "lora", "q_proj_a")``, read in place by layer as the projections are)."""
    return bool(path) and (path[-1] in DENSE_WEIGHTS or (len(path) > 1 and (
        (path[-2] in DENSE_WEIGHTS and path[-1] in PARTS) or path[-2] == "lora")))


def dense_modules(model: nnx.Module) -> list[nnx.Module]:
    """Every module of ``model`` whose projections go through a ``dense_fn``."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module) and hasattr(node, "dense_fn")]


def attention_modules(model: nnx.Module) -> list[Attention]:
    """Every attention layer of ``model``: where its attention kernel and KV write are chosen."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Attention)]


def kernel_name(fn: Callable) -> str:
    """The name of an attention kernel or KV write, for logs and for comparing processes' choices."""
    fn = getattr(fn, "func", fn)                       # a functools.partial
    return getattr(fn, "__name__", type(fn).__name__)
