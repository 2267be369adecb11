"""The projection matmuls of a step on the CPU: XLA's dot against OpenBLAS (jaxengine/kernels/matmul), first
the 30 layers' projections alone at the default model's shapes, then whole steps of the default
model, the two run in turns in one process.

    python scripts/bench_matmul.py [--repeats 7] [--json PATH]

Layers alone: "XLA, scanned slices" is the layer scan slicing each layer's weights out of the
stack (what the model did before); "XLA, index" and "OpenBLAS, index" take the whole stack and
the layer's index. Whole steps: the same jitted step, its projections through ``xla_dense`` or
``dense``; the greedy tokens must agree.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import profile_step  # noqa: E402  (the step shapes and the greedy sampler's inputs)

from jaxengine.default_model import default_model_path  # noqa: E402
from jaxengine.kernels.matmul import cpu_matmul, xla_dense  # noqa: E402
from jaxengine.kernels.paged_attention import AttentionMetadata  # noqa: E402
from jaxengine.models.forward import make_forward  # noqa: E402
from jaxengine.models.layers import dense_modules  # noqa: E402
from jaxengine.models.llama import init_kv_caches  # noqa: E402
from jaxengine.models.weights import load_model  # noqa: E402


def in_turns(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls run in turns after one warm-up each."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def layer_weights(cfg) -> list[jax.Array]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = ((d, qkv), (cfg.num_heads * cfg.head_dim, d), (d, f), (d, f), (f, d))
    key = jax.random.key(0)
    return [jax.random.normal(key, (cfg.num_layers, *s), jnp.float32) * 0.02 for s in shapes]


def projections_alone(cfg, tokens: int, repeats: int) -> dict[str, float]:
    o = cfg.num_heads * cfg.head_dim
    ws = layer_weights(cfg)
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.hidden_size), jnp.float32)

    def layer(mm, x, w, index):
        a, b, g, u, e = w
        x = x + mm(mm(x, a, index)[:, :o], b, index)
        return x + mm(jax.nn.silu(mm(x, g, index)) * mm(x, u, index), e, index)

    sliced = jax.jit(lambda x, ws: jax.lax.scan(lambda x, w: (layer(xla_dense, x, w, None), None), x, ws)[0])

    def by_index(mm):
        return jax.jit(lambda x, ws: jax.lax.scan(lambda x, i: (layer(mm, x, ws, i), None), x,
                                                  jnp.arange(cfg.num_layers))[0])

    xla_index, blas_index = by_index(xla_dense), by_index(cpu_matmul.matmul)
    return in_turns({"XLA, scanned slices": lambda: sliced(x, ws).block_until_ready(),
                     "XLA, index": lambda: xla_index(x, ws).block_until_ready(),
                     "OpenBLAS, index": lambda: blas_index(x, ws).block_until_ready()}, repeats)


def whole_steps(path, rows, num_blocks, num_tokens, num_rows, repeats) -> tuple[dict[str, float], bool]:
    md = AttentionMetadata.build(rows, profile_step.BLOCK, num_tokens=num_tokens,
                                 max_blocks=max(len(r[2]) for r in rows) + 1, num_rows=num_rows)
    last = np.cumsum([n for _, n, _ in rows]) - 1
    logits_indices = jnp.asarray(np.pad(last, (0, num_rows - len(rows))))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 1000, num_tokens), jnp.int32)
    head = profile_step.step_variants()["whole step (greedy sampler)"][2]
    calls, tokens = {}, {}
    for name in ("XLA's dot", "OpenBLAS"):
        model, cfg = load_model(path)
        if name == "XLA's dot":
            for module in dense_modules(model):
                module.dense_fn = xla_dense
        state, forward = make_forward(model, head=head)
        caches = [init_kv_caches(cfg, num_blocks, profile_step.BLOCK)]
        smd = profile_step.greedy_metadata(num_rows, cfg.vocab_size)

        def call(forward=forward, state=state, caches=caches, smd=smd, name=name):
            caches[0], out = forward(state, caches[0], ids, md, logits_indices, smd)
            tokens[name] = np.asarray(jax.block_until_ready(out))

        calls[name] = call
    times = in_turns(calls, repeats)
    return times, bool((tokens["XLA's dot"] == tokens["OpenBLAS"]).all())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    if not cpu_matmul.available():
        raise SystemExit("the CPU matmul kernel is not available here (see the warning above)")
    path = default_model_path(progress=False)
    _, cfg = load_model(path)
    report = {"projections alone": {}, "whole steps": {}}
    print("the 30 layers' projections alone (ms)")
    for tokens in (1, 16, 64, 512):
        times = projections_alone(cfg, tokens, args.repeats)
        report["projections alone"][tokens] = times
        print(f"  {tokens} tokens: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()), flush=True)
    rng = np.random.default_rng(0)
    print("whole steps of the default model (ms)")
    for kind, (rows, blocks), num_tokens, num_rows in (
            ("decode, batch 1, context 300", profile_step.decode_rows(rng, 1, 300, 300), 1, 1),
            ("decode, batch 16, contexts 256-320", profile_step.decode_rows(rng, 16, 256, 320), 16, 16),
            ("decode, batch 64, contexts 300-700", profile_step.decode_rows(rng), 64, 64),
            ("prefill, 4 prompts of 128 tokens", profile_step.prefill_rows(), 512, 8)):
        times, same = whole_steps(path, rows, blocks + 1, num_tokens, num_rows, args.repeats)
        report["whole steps"][kind] = {**times, "same tokens": same}
        print(f"  {kind}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()) + f", same tokens: {same}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
