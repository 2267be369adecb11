"""A lower bound on the time of the offline workload (bench_offline.py's) on this machine: the
roofline of every step, with the ceilings measured in this run.

    python scripts/roofline_offline.py [--baseline-tok-s 78.8]

Prefill: the projection and MLP FLOPs of every prompt token at the f32 matmul rate. Decode: the
best possible batching (every live request decodes in every step, so the number of steps is the
longest output); each step is at least max(FLOPs / matmul rate, bytes / copy bandwidth), the bytes
being the f32 weights (read once per step) and the KV cache of every live request (read once per
step). Attention FLOPs and everything else are left out, so the true floor is higher.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from bench_offline import workload
from flax import nnx

from jaxengine.costmodel.floors import floor_seconds, flops_per_token, kv_bytes_per_token, matmul_gflops
from jaxengine.default_model import default_model_path
from jaxengine.models.weights import load_model


def copy_gbs(mib: int = 512, repeats: int = 5) -> float:
    x = jnp.ones((mib << 20) // 4, jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    return 2 * x.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-tok-s", type=float, default=None, help="transformers' figure to compare with")
    p.add_argument("--kv-bytes", type=int, default=4, help="bytes per KV element (4: f32, 2: bf16)")
    args = p.parse_args()
    model, cfg = load_model(default_model_path(progress=False))
    prompts, outputs = workload(64, cfg.vocab_size)
    peak, bandwidth = matmul_gflops() * 1e9, copy_gbs() * 1e9
    flops = flops_per_token(cfg)
    weight_bytes = sum(w.nbytes for path, w in nnx.to_flat_state(nnx.state(model)) if path[0] != "embed_tokens")
    kv_per_token = kv_bytes_per_token(cfg, args.kv_bytes)
    prefill_s = floor_seconds(sum(len(x) for x in prompts) * flops, peak)
    decode_s = 0.0
    for step in range(max(outputs)):
        live = [(len(x), n) for x, n in zip(prompts, outputs) if step < n]
        context = sum(length + step for length, _ in live)
        decode_s += floor_seconds(len(live) * flops, peak, weight_bytes + context * kv_per_token, bandwidth)
    tokens = sum(outputs)
    floor_tok_s = tokens / (prefill_s + decode_s)
    print(f"measured: f32 matmul {peak / 1e9:.0f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"floor: prefill {prefill_s:.1f} s + decode {decode_s:.1f} s = {prefill_s + decode_s:.1f} s "
          f"for {tokens} output tokens -> at most {floor_tok_s:.0f} output tok/s (KV {args.kv_bytes} bytes)")
    if args.baseline_tok_s:
        print(f"= {floor_tok_s / args.baseline_tok_s:.2f}x the baseline's {args.baseline_tok_s} tok/s; 5x needs "
              f"{5 * args.baseline_tok_s / floor_tok_s:.0%} of this floor")


if __name__ == "__main__":
    main()
