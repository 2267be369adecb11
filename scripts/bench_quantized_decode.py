"""The quantized matmul kernel at decode size, in both layouts: the default model's weights (30
layers of q, k, v, o, gate, up and down, int4 in groups of 32 with float16 scales and offsets as its
Q4_1 GGUF, and the LM head [576, 49152], int8 in groups of 32 as its Q8_0 embedding, ~96 MB in
all: more than the last-level cache, as in a step) multiplied by one row of x in the order a
decode step does (q, k and v in one call; gate and up in one), each weight read in place from its
stack by XLA's loop; row-major weights (``QuantizedWeight``) against the same weights laid out as
tiles (``TiledWeight``), alternating.

    python scripts/bench_quantized_decode.py [--rows 1] [--repeats 30]

Prints each layout's time for the whole pass, the bytes read per second, and the largest error
of the LM head's product against float64 on the dequantised weights (relative to its largest
output). The tiled layout needs a CPU with AVX-512 VNNI and VBMI.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.kernels.matmul import dense, dense_each
from jaxengine.kernels.matmul.quantized import (FORMATS, QuantizedWeight, dequantize_reference, pack_int4, quantize,
                                                tile, tiles_available)

LAYERS = 30
# K x N per layer, in a step's order: (q, k, v), o, (gate, up), down
CALLS = [[(576, 576), (576, 192), (576, 192)], [(576, 576)], [(576, 1536), (576, 1536)], [(1536, 576)]]
HEAD = (576, 49152)


def weight(rng, shape: tuple[int, ...], fmt: str) -> tuple[QuantizedWeight, np.ndarray, np.ndarray]:
    """A random weight quantized along its K axis (axis -2): (the weight, its values, dequantised)."""
    w = rng.standard_normal(shape, np.float32) * 0.05
    values, scale, zero = quantize(w, fmt, 32, axis=-2, offset=fmt.startswith("int4"))
    q = pack_int4(values, axis=-2) if FORMATS[fmt].bits == 4 else values
    qw = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale), None if zero is None else jnp.asarray(zero),
                         FORMATS[fmt].bits)
    return qw, q, dequantize_reference(values, scale, zero, axis=-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not tiles_available():
        raise SystemExit("this CPU has no tiled layout (AVX-512 VNNI and VBMI): nothing to compare")
    rng = np.random.default_rng(0)
    layers = [[weight(rng, (LAYERS, k, n), "int4")[0] for k, n in call] for call in CALLS]
    head, _, head_f32 = weight(rng, HEAD, "int8")
    nbytes = sum(a.nbytes for call in layers for w in call for a in jax.tree.leaves(w)) + sum(
        a.nbytes for a in jax.tree.leaves(head))
    layouts = {"rows": (layers, head),
               "tiles": ([[tile(w, stacked=True) for w in call] for call in layers], tile(head, stacked=False))}
    x = jnp.asarray(rng.standard_normal((args.rows, 576), np.float32))
    wide = jnp.asarray(rng.standard_normal((args.rows, 1536), np.float32))       # down's x

    @jax.jit
    def step(x, wide, layers, head):
        def layer(i, acc):                      # acc: each layer's x depends on the last layer's products
            outs = []
            for call, xi in zip(layers, (x, x, x, wide)):
                xi = xi + acc
                outs += dense_each(dense, xi, call, i) if len(call) > 1 else [dense(xi, call[0], i)]
            return acc + 1e-30 * sum(o[:, :1] for o in outs)
        acc = jax.lax.fori_loop(0, LAYERS, layer, jnp.zeros((x.shape[0], 1), jnp.float32))
        return acc, dense(x, head)

    times = {name: [] for name in layouts}
    for name, (ls, h) in layouts.items():
        jax.block_until_ready(step(x, wide, ls, h))
    for _ in range(args.repeats):
        for name, (ls, h) in layouts.items():
            start = time.perf_counter()
            jax.block_until_ready(step(x, wide, ls, h))
            times[name].append(time.perf_counter() - start)
    want = np.asarray(x, np.float64) @ head_f32.astype(np.float64)
    for name, (ls, h) in layouts.items():
        t = float(np.median(times[name]))
        error = np.abs(np.asarray(step(x, wide, ls, h)[1]) - want).max() / np.abs(want).max()
        print(f"{name:5s}: {t * 1e3:6.2f} ms for the 30 layers' projections and the LM head at {args.rows} row(s), "
              f"{nbytes / t / 1e9:5.1f} GB/s, LM head error {error:.1e}")


if __name__ == "__main__":
    main()
