"""The roofline, and the ceilings it is stated against.

A step takes at least as long as reading its bytes at the memory bandwidth and as running its
FLOPs at the peak rate, whichever is longer (``floor_seconds``). Every floor in the project comes
from here: the bench tool's matmul baseline (``latency --baseline matmul``, the offline presets'
share of the peak), the GPU benchmark's decode floor, the offline workload's lower bound and the
lab's what-if profiles of machines that are not here (``jaxengine.costmodel.roofline``).
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp


def floor_seconds(flops: float, flops_per_s: float, bytes_read: float = 0.0,
                  bandwidth_bytes_s: float = math.inf) -> float:
    """The roofline: the larger of ``flops / flops_per_s`` and ``bytes_read / bandwidth_bytes_s``
    (without bytes, the compute roof alone)."""
    return max(bytes_read / bandwidth_bytes_s, flops / flops_per_s)


def attention_layers(model) -> int:
    """The layers that keep KV and attend (a hybrid model's attention layers only)."""
    return getattr(model, "num_kv_layers", 0) or model.num_layers


def kv_bytes_per_token(model, bytes_per_element: float) -> float:
    """The KV cache one token holds: a K and a V row per attention layer and KV head (latent
    attention: its latent and rotary key per layer). A hybrid model's recurrent layers hold none."""
    if getattr(model, "is_mla", False):
        return model.kv_elements_per_token * bytes_per_element
    return 2 * attention_layers(model) * model.num_kv_heads * model.head_dim * bytes_per_element


def attention_flops(model, attention_work: float) -> float:
    """Attention's FLOPs: q.k and p.v, a multiply-add (2 FLOPs) each per query head and head
    element, for each of ``attention_work`` (query token, attended token) pairs (latent attention,
    absorbed: keys of R + Hr and values of R), in the layers that attend."""
    if getattr(model, "is_mla", False):
        per_head = 2 * (2 * model.kv_lora_rank + model.head_dim)
        return model.num_layers * model.num_heads * per_head * attention_work
    return 4 * attention_layers(model) * model.num_heads * model.head_dim * attention_work


def step_floor_seconds(model, num_params: float, num_tokens: float, context_tokens: float, attention_work: float,
                       *, bytes_per_param: float, bandwidth_bytes_s: float, flops_per_s: float,
                       num_active_params: float | None = None, num_rows: float = 0) -> float:
    """The floor of one step of a transformer (``model``: layers, heads, KV heads, head size).
    Read: ``num_params`` weights once (a mixture of experts: those of the experts the step's
    tokens touch), and the KV cache of the ``context_tokens`` the rows attend to. FLOPs: a
    multiply-add per parameter a token runs through (``num_active_params``, default all) per
    scheduled token, and attention over ``attention_work`` pairs. The KV cache is held in the
    weights' dtype. A hybrid model's recurrent layers read and write each of the step's
    ``num_rows`` sequences' states once (``state_bytes_per_slot``, float32), whatever its context."""
    active = num_params if num_active_params is None else num_active_params
    bytes_read = num_params * bytes_per_param + context_tokens * kv_bytes_per_token(model, bytes_per_param)
    bytes_read += 2 * num_rows * getattr(model, "state_bytes_per_slot", 0)
    flops = 2 * active * num_tokens + attention_flops(model, attention_work)
    return floor_seconds(flops, flops_per_s, bytes_read, bandwidth_bytes_s)


def flops_per_token(cfg) -> float:
    """Matmul FLOPs per token outside attention (projections and MLP, of a mixture of experts the
    experts a token runs through; logits are for one row)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    if getattr(cfg, "is_hybrid", False):   # the parameters a token runs through, less the embedding and head
        return 2.0 * (cfg.num_active_params - cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2) - d)
    attention = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * h + cfg.num_heads * h * d
    if getattr(cfg, "is_mla", False):      # each weight once a token (absorbed: kv_b_proj takes q in, the output out)
        attention = cfg.latent_attention_params
    sparse = len(cfg.sparse_layers)
    experts = d * cfg.num_experts + 3 * d * (cfg.num_experts_per_tok * cfg.moe_intermediate_size
                                             + cfg.shared_expert_intermediate_size)
    return 2.0 * (cfg.num_layers * attention + (cfg.num_layers - sparse) * 3 * d * f + sparse * experts)


def matmul_gflops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """XLA's matmul throughput on the default device, best of ``repeats`` (n x n operands)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
