"""The mixture-of-experts layer on the CPU, against what it replaces and what it must beat.

    python scripts/bench_moe.py [--repeats 7] [--json PATH] [--parts one_device mesh_of_8 quantized]

1. One layer's experts (router, top-k, grouped SwiGLU, combine) at decode and prefill token
   counts, against a dense SwiGLU MLP of the same *active* parameters (width k x F) and against
   the dense reference (every expert on every token, masked): all three jitted, run in turns.
   The grouped layer reads the experts its tokens touch, the dense MLP its one matrix, so at
   decode batches that touch many experts the weights read set the floor: printed beside it.
2. The same layer over 8 simulated CPU devices: tensor-parallel experts (each device every
   expert's F / 8 columns) against expert-parallel ones (each device 8 whole experts), these
   with every token on every device (replicate and reduce, the engine's) or dispatched to their
   experts' devices by all-to-all (``models.mesh.AllToAllExperts``). The
   simulated devices share this machine's cores, so this is the layout's overhead (the extra
   collectives and the per-device grouping), not a speed-up.
3. The same layer with its experts kept quantized as ``--quantization`` keeps them (fp8 and int8
   per output channel, int4 in groups of 128 with offsets) against f32, on one device: ms per
   call and the experts' resident bytes. int8 and int4 run the CPU's grouped quantized kernel
   (only the chosen experts' bytes read), fp8 XLA's dequantise-then-ragged_dot.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxengine.models.config import ModelConfig  # noqa: E402
from jaxengine.models.layers import MLP  # noqa: E402
from jaxengine.models.mesh import AllToAllExperts, ShardedExperts, make_mesh, place_model  # noqa: E402
from jaxengine.models.moe import SparseMoeBlock, dense_reference, with_quantized_experts  # noqa: E402

# A Qwen3-MoE-like layer scaled to this CPU: 64 experts, top 4, expert width 256, model width 1024.
CFG = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=1024, intermediate_size=1024,
                  num_layers=1, num_heads=8, num_kv_heads=8, head_dim=128, num_experts=64, num_experts_per_tok=4,
                  moe_intermediate_size=256, norm_topk_prob=True)
TOKENS = (1, 16, 64, 256, 512)


def in_turns(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls run in turns after one warm-up each."""
    for call in calls.values():
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def jitted(module: nnx.Module, fn):
    graphdef, state = nnx.split(module)
    step = jax.jit(lambda state, x: fn(nnx.merge(graphdef, state), x))
    return lambda x: step(state, x)


def touched_experts(block: SparseMoeBlock, x: jax.Array) -> int:
    from jaxengine.models.moe import route

    _, experts = route(x @ block.router[...], CFG.num_experts_per_tok, CFG.norm_topk_prob)
    return len(set(np.asarray(experts).ravel().tolist()))


def read_gbs(mib: int = 512, repeats: int = 5) -> float:
    """This machine's read bandwidth: a sum over ``mib`` MiB of f32, best of ``repeats``."""
    x = jnp.ones((mib << 20) // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(in_turns({"sum": lambda: total(x)}, 1)["sum"] for _ in range(repeats))
    return x.nbytes / best / 1e9


def one_device(repeats: int) -> list[dict]:
    block = SparseMoeBlock(CFG, jnp.float32, rngs=nnx.Rngs(0))
    dense = MLP(CFG, jnp.float32, intermediate_size=CFG.num_experts_per_tok * CFG.moe_intermediate_size,
                rngs=nnx.Rngs(1))
    grouped = jitted(block, lambda m, x: m(x)[0])
    reference = jitted(block, lambda m, x: dense_reference(m, x))
    mlp = jitted(dense, lambda m, x: m(x))
    expert_bytes = 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4
    bandwidth = read_gbs() * 1e9
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for t in TOKENS:
        x = jax.random.normal(jax.random.key(t), (t, CFG.hidden_size))
        np.testing.assert_allclose(grouped(x), reference(x), rtol=1e-3, atol=1e-3)
        s = in_turns({"grouped": lambda: grouped(x), "dense_mlp": lambda: mlp(x), "reference": lambda: reference(x)},
                     repeats)
        touched = touched_experts(block, x)
        rows.append({"tokens": t, **{k: v * 1e3 for k, v in s.items()}, "experts_touched": touched,
                     "weights_read_ratio": touched / CFG.num_experts_per_tok,
                     "grouped_read_floor_ms": touched * expert_bytes / bandwidth * 1e3,
                     "read_gbs": bandwidth / 1e9})
        r = rows[-1]
        print(f"{t:4d} tokens: grouped {r['grouped']:7.2f} ms, dense MLP of the active size {r['dense_mlp']:7.2f} ms "
              f"({r['grouped'] / r['dense_mlp']:.2f}x), every expert on every token {r['reference']:8.2f} ms; "
              f"{touched} experts touched: {r['weights_read_ratio']:.1f}x the dense MLP's weights, read floor "
              f"{r['grouped_read_floor_ms']:.2f} ms", flush=True)
    return rows


def over_the_mesh(repeats: int) -> list[dict]:
    mesh = make_mesh(jax.devices()[:8])
    blocks = {}
    for ep in (False, True):
        block = SparseMoeBlock(CFG, jnp.float32, expert_parallel=ep, rngs=nnx.Rngs(0))
        place_model(block, mesh)
        block.experts.experts_fn = ShardedExperts(mesh, ep)
        blocks["expert-parallel" if ep else "tensor-parallel"] = jitted(block, lambda m, x: m(x)[0])
    dispatched = SparseMoeBlock(CFG, jnp.float32, expert_parallel=True, rngs=nnx.Rngs(0))
    place_model(dispatched, mesh)
    dispatched.experts.experts_fn = AllToAllExperts(mesh)
    blocks["all-to-all"] = jitted(dispatched, lambda m, x: m(x)[0])
    single = SparseMoeBlock(CFG, jnp.float32, rngs=nnx.Rngs(0))
    one = jitted(single, lambda m, x: m(x)[0])
    rows = []
    for t in TOKENS:
        x = jax.random.normal(jax.random.key(t), (t, CFG.hidden_size))
        for name, call in blocks.items():
            np.testing.assert_allclose(call(x), one(x), rtol=1e-3, atol=1e-3, err_msg=name)
        calls = {name: (lambda call=call: call(x)) for name, call in blocks.items()}
        s = in_turns({**calls, "one device": lambda: one(x)}, repeats)
        rows.append({"tokens": t, **{k: v * 1e3 for k, v in s.items()}})
        print(f"{t:4d} tokens on 8 simulated devices: TP {s['tensor-parallel'] * 1e3:7.2f} ms, "
              f"EP {s['expert-parallel'] * 1e3:7.2f} ms, EP by all-to-all {s['all-to-all'] * 1e3:7.2f} ms "
              f"(one device {s['one device'] * 1e3:7.2f} ms)", flush=True)
    return rows


def quantized_experts(repeats: int) -> list[dict]:
    block = SparseMoeBlock(CFG, jnp.float32, rngs=nnx.Rngs(0))
    copies = {scheme: with_quantized_experts(block, scheme) for scheme in ("fp8", "int8", "int4")}
    calls = {"f32": jitted(block, lambda m, x: m(x)[0]),
             **{scheme: jitted(c, lambda m, x: m(x)[0]) for scheme, c in copies.items()}}

    def expert_bytes(b: SparseMoeBlock) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(nnx.state(b.experts)))

    sizes = {"f32": expert_bytes(block), **{s: expert_bytes(c) for s, c in copies.items()}}
    print("experts' resident bytes: " + ", ".join(f"{k} {v / 2**20:.1f} MiB ({v / sizes['f32']:.3f})"
                                                  for k, v in sizes.items()))
    rows = []
    for t in TOKENS:
        x = jax.random.normal(jax.random.key(t), (t, CFG.hidden_size))
        want = calls["f32"](x)
        drift = {s: float(jnp.abs(calls[s](x) - want).mean() / jnp.abs(want).mean()) for s in copies}
        s = in_turns({name: (lambda call=call: call(x)) for name, call in calls.items()}, repeats)
        rows.append({"tokens": t, **{k: v * 1e3 for k, v in s.items()},
                     **{f"{k}_relative_error": v for k, v in drift.items()}})
        print(f"{t:4d} tokens, quantized experts: " + ", ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in s.items()) +
              "; mean |delta| / mean |out|: " + ", ".join(f"{k} {v:.4f}" for k, v in drift.items()), flush=True)
    return [{"expert_bytes": sizes}, *rows]


PARTS = {"one_device": one_device, "mesh_of_8": over_the_mesh, "quantized": quantized_experts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default="bench_results/bench_moe.json")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    args = p.parse_args()
    result = {"config": {k: getattr(CFG, k) for k in ("hidden_size", "num_experts", "num_experts_per_tok",
                                                      "moe_intermediate_size")},
              **{part: PARTS[part](args.repeats) for part in args.parts}}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
