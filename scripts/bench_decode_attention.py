"""One layer's decode attention on the CPU, the compiled kernel (``cpu_decode``) against the jnp
loop it replaces, at the default model's heads (3 KV heads, 3 queries each, head size 64, 16-token
pages, f32), each row on its own pages scattered through a pool larger than the caches.

    python scripts/bench_decode_attention.py [--rounds 5] [--prompt 512]

Rows have contexts uniform in 300-700 (batch 1: 500). The two variants run in turns, the best
of ``--rounds`` medians of 5 calls each, beside the KV bytes read and the rate. ``--prompt N``
adds one prompt of N tokens (a prefill from an empty context: each token attends to those up to
it), the rate then counted over the keys each token reads.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.kernels.paged_attention.tiled import paged_attention_tiled

KV_HEADS, GROUP, HEAD, PAGE = 3, 3, 64, 16
POOL_PAGES = 8192                     # 400 MB of K and V: more than the caches hold


def batch(rng, rows: int, prompt: int = 0):
    """``rows`` decodes, or (``prompt`` > 0) one prompt of that many tokens -> (metadata, tokens,
    KV bytes read)."""
    shapes = [(0, prompt)] if prompt else [(c, 1) for c in ([500] if rows == 1 else rng.integers(300, 701, rows))]
    pages = rng.permutation(np.arange(1, POOL_PAGES))
    table, used = [], 0
    for c, new in shapes:
        n = -(-(int(c) + new) // PAGE)
        table.append((int(c), new, pages[used:used + n].tolist()))
        used += n
    tokens = sum(new for _, new in shapes)
    md = AttentionMetadata.build(table, PAGE, num_tokens=tokens, max_blocks=max(len(t[2]) for t in table) + 1)
    keys = sum(c * new + new * (new + 1) // 2 for c, new in shapes)
    return md, tokens, keys * KV_HEADS * HEAD * 2 * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=0, help="also one prompt of this many tokens")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    k_cache, v_cache = (jax.random.normal(k, (POOL_PAGES, PAGE, KV_HEADS, HEAD), jnp.float32)
                        for k in jax.random.split(key))
    print("| rows | jnp loop | kernel | speed-up | kernel's rate |\n|---|---|---|---|---|")
    for rows in (1, 8, 64) + ((-args.prompt,) if args.prompt else ()):
        md, tokens, kv_bytes = batch(rng, rows, max(-rows, 0))
        q = jax.random.normal(key, (tokens, KV_HEADS * GROUP, HEAD), jnp.float32)
        fns = {flag: jax.jit(lambda q, k, v, md, flag=flag: paged_attention_tiled(
            q, k, v, md, scale=HEAD ** -0.5, decode_kernel=flag)) for flag in (False, True)}
        best = {flag: float("inf") for flag in fns}
        for fn in fns.values():
            jax.block_until_ready(fn(q, k_cache, v_cache, md))
        for _ in range(args.rounds):
            for flag, fn in fns.items():
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k_cache, v_cache, md))
                    times.append(time.perf_counter() - t0)
                best[flag] = min(best[flag], statistics.median(times))
        loop, kernel = best[False] * 1e3, best[True] * 1e3
        print(f"| {rows if rows > 0 else f'a prompt of {-rows}'} | {loop:.2f} ms | {kernel:.2f} ms | {loop / kernel:.2f}x | "
              f"{kv_bytes / best[True] / 1e9:.1f} GB/s |", flush=True)


if __name__ == "__main__":
    main()
