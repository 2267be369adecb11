"""The quantized matmul kernel at decode size: the default model's projections (q/o, k/v,
gate/up, down: K x N of 576 x 576, 576 x 192, 576 x 1536, 1536 x 576, int4 in groups of 32 with
float16 scales and offsets, as its Q4_1 GGUF) for 30 stacked layers, one row of x, each layer's
weight read in place from the stack by XLA's loop, as a decode step does.

    python scripts/bench_quantized_decode.py [--rows 1] [--format int4]

Prints each shape's time per layer, the bytes read per second (values, scales, offsets), the
error against float64 on the dequantised weights (relative to the largest output), and the 30
layers' seven projections together. Run it in another checkout (a git worktree) for a baseline.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.matmul.quantized import (FORMATS, QuantizedWeight, dequantize_reference, pack_int4,
                                                quantize, quantized_dense)

LAYERS = 30
SHAPES = {"q/o": (576, 576, 2), "k/v": (576, 192, 2), "gate/up": (576, 1536, 2), "down": (1536, 576, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    fmt, m, total = args.format, args.rows, 0.0
    for name, (k, n, count) in SHAPES.items():
        w = rng.standard_normal((LAYERS, k, n), np.float32) * 0.05
        values, scale, zero = quantize(w, fmt, 32, axis=1, offset=fmt.startswith("int4"))
        q = pack_int4(values, axis=1) if FORMATS[fmt].bits == 4 else values
        qw = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale), None if zero is None else jnp.asarray(zero),
                             FORMATS[fmt].bits)
        ref = dequantize_reference(values, scale, zero, axis=1)
        x = rng.standard_normal((m, k), np.float32)
        step = jax.jit(lambda x, qw: jax.lax.fori_loop(
            0, LAYERS, lambda i, acc: acc + quantized_dense(x, qw, i), jnp.zeros((m, n), jnp.float32)))
        out = np.asarray(step(x, qw).block_until_ready())
        want = sum(x.astype(np.float64) @ ref[i].astype(np.float64) for i in range(LAYERS))
        error = np.abs(out - want).max() / np.abs(want).max()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step(x, qw).block_until_ready()
            times.append(time.perf_counter() - start)
        t = float(np.median(times))
        nbytes = q.nbytes + scale.nbytes + (0 if zero is None else zero.nbytes)
        total += t * count
        print(f"{name:8s} {m} row(s): {t / LAYERS * 1e6:7.1f} us a layer, {nbytes / t / 1e9:5.1f} GB/s, "
              f"error {error:.1e}")
    print(f"the 30 layers' seven projections: {total * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
