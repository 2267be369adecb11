"""CPU forward-pass time per token for the default model (SmolLM2-135M) at a few token buckets,
and load time: cold GGUF (parse + dequantise + convert) vs the converted-weights cache.

    python scripts/bench_model.py [--buckets 16 64 256 1024] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.default_model import default_model_path
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import make_forward
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.weights import load_model

BLOCK = 16


def time_load(path) -> dict:
    """Cold: an empty cache folder; cached: the same folder again."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["JAXENGINE_CACHE"] = tmp
        t0 = time.perf_counter()
        load_model(path)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, cfg = load_model(path)
        cached = time.perf_counter() - t0
    os.environ.pop("JAXENGINE_CACHE")
    return {"cold_s": cold, "cached_s": cached, "model": model, "cfg": cfg}


def time_forward(model, cfg, num_tokens: int, repeats: int) -> dict:
    """One prefill row of ``num_tokens`` tokens (all new), logits for the last token only."""
    state, forward = make_forward(model)
    max_blocks = -(-num_tokens // BLOCK)
    caches = init_kv_caches(cfg, max_blocks + 1, BLOCK)
    md = AttentionMetadata.build([(0, num_tokens, list(range(1, max_blocks + 1)))], BLOCK, num_tokens, max_blocks)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, num_tokens), jnp.int32)
    last = jnp.asarray([num_tokens - 1])
    t0 = time.perf_counter()
    caches, logits = forward(state, caches, ids, md, last)
    logits.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        caches, logits = forward(state, caches, ids, md, last)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"tokens": num_tokens, "compile_s": compile_s, "step_ms": best * 1e3, "us_per_token": best / num_tokens * 1e6}


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Baseline measured in the same run: XLA's f32 matmul throughput on this machine."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def flops_per_token(cfg) -> float:
    """Matmul FLOPs per token outside attention (projections and MLP; logits are for one row)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * h + cfg.num_heads * h * d + 3 * d * f
    return 2.0 * per_layer * cfg.num_layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    path = default_model_path()
    load = time_load(path)
    print(f"load: cold GGUF {load['cold_s']:.2f} s, converted cache {load['cached_s']:.2f} s "
          f"({load['cold_s'] / load['cached_s']:.1f}x faster)")
    gflops = matmul_gflops()
    floor_us = flops_per_token(load["cfg"]) / (gflops * 1e9) * 1e6
    print(f"baseline: f32 matmul {gflops:.0f} GFLOP/s -> {floor_us:.0f} us/token for the non-attention matmuls")
    rows = [time_forward(load["model"], load["cfg"], n, args.repeats) for n in args.buckets]
    for r in rows:
        r["x_floor"] = r["us_per_token"] / floor_us
        print(f"bucket {r['tokens']:5d}: {r['step_ms']:8.1f} ms/step  {r['us_per_token']:8.1f} us/token  "
              f"{r['x_floor']:5.2f}x the matmul floor  (compile {r['compile_s']:.1f} s)")
    print(json.dumps({"backend": jax.default_backend(), "matmul_gflops": round(gflops, 1),
                      "floor_us_per_token": round(floor_us, 1), "load_cold_s": round(load["cold_s"], 3),
                      "load_cached_s": round(load["cached_s"], 3),
                      "forward": [{k: round(v, 3) for k, v in r.items()} for r in rows]}))


if __name__ == "__main__":
    main()
