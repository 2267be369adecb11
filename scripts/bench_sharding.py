"""What the tensor-parallel machinery costs on one device: the engine's step on a mesh of one
device (parameters in NamedShardings, kernels inside shard_map, explicit output shardings)
against the unsharded path on the same device, same model, same workload, measured in turns.

Workload: random-weight Llama-shaped model, ``--batch`` requests of ``--prompt`` tokens, each
generating ``--output`` tokens greedily (one prefill step, then decode steps). Reports the
median prefill and decode step (wall time of ``Engine.step``, which waits for the results) of
each path and the ratio mesh / unsharded. ``--tp 2,4`` adds meshes of more (simulated on the
CPU: there only their correctness is meaningful, their times are reported for the record).

    python scripts/bench_sharding.py [--size cpu|1b] [--repeats 5] [--tp 2,4] [--out sharding.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--tp" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxengine import EngineArgs, SamplingParams  # noqa: E402
from jaxengine.bench.report import write_result  # noqa: E402
from jaxengine.engine import Engine  # noqa: E402
from jaxengine.kernels.paged_attention.backend import select_attention  # noqa: E402
from jaxengine.models.config import ModelConfig  # noqa: E402
from jaxengine.models.llama import LlamaForCausalLM  # noqa: E402
from jaxengine.models.mesh import make_mesh  # noqa: E402
from jaxengine.runner.model_runner import ModelRunner  # noqa: E402

SIZES = {   # (config, dtype, batch, prompt, output)
    "cpu": (ModelConfig("LlamaForCausalLM", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
                        num_heads=8, num_kv_heads=4, head_dim=64), "float32", 16, 64, 24),
    "1b": (ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0),
           "bfloat16", 64, 128, 32),
}


def build_engine(cfg: ModelConfig, dtype, batch: int, prompt: int, output: int, mesh) -> Engine:
    """The engine as LLM builds it, on ``mesh`` (None: the unsharded path)."""
    model = LlamaForCausalLM(cfg, dtype, select_attention("auto"), rngs=nnx.Rngs(0))
    budget = batch * prompt
    args = EngineArgs(max_num_seqs=batch, max_num_batched_tokens=budget, block_size=16,
                      max_model_len=prompt + output + 16, enable_prefix_caching=False,
                      num_kv_blocks=batch * ((prompt + output) // 16 + 2) + 1,
                      token_buckets=[batch, budget], request_buckets=[batch],
                      tensor_parallel_size=1 if mesh is None else mesh.size)
    config = args.create_engine_config(cfg, dtype)
    runner = ModelRunner(model, cfg, config, dtype=dtype, progress=False, token_buckets=args.token_buckets,
                         request_buckets=args.request_buckets, mesh=mesh)
    return Engine(config, runner)


def run_workload(engine: Engine, cfg: ModelConfig, batch: int, prompt: int, output: int, seed: int) -> dict:
    """Step times (s) of one pass, split into prefill and decode steps, and the tokens."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    requests = [engine.add_request(f"{seed}-{i}", rng.integers(0, cfg.vocab_size, prompt).tolist(), params)
                for i in range(batch)]
    prefill, decode = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        (prefill if engine.last_trace.num_prefill_tokens else decode).append(wall)
    engine.flush()
    return {"prefill": prefill, "decode": decode, "tokens": [r.seqs[0].output_token_ids for r in requests]}


def compare(size: str, repeats: int, tps: list[int]) -> dict:
    cfg, dtype_name, batch, prompt, output = SIZES[size]
    dtype = jnp.dtype(dtype_name)
    device = jax.devices()[0]
    paths = {"unsharded": None, "mesh of 1": make_mesh([device])}
    paths.update({f"mesh of {tp}": make_mesh(jax.devices()[:tp]) for tp in tps})
    engines = {name: build_engine(cfg, dtype, batch, prompt, output, mesh) for name, mesh in paths.items()}
    times = {name: {"prefill": [], "decode": []} for name in engines}
    tokens = {}
    for rep in range(repeats + 1):                   # turn by turn; the first pass warms up
        for name, engine in engines.items():
            run = run_workload(engine, cfg, batch, prompt, output, seed=rep)
            tokens.setdefault(rep, {})[name] = run["tokens"]
            if rep:
                times[name]["prefill"] += run["prefill"]
                times[name]["decode"] += run["decode"]
    result = {"size": size, "device": str(device), "jax": jax.__version__, "dtype": dtype_name, "batch": batch,
              "prompt": prompt, "output": output, "repeats": repeats,
              "same_tokens": all(len({json.dumps(t) for t in per.values()}) == 1 for per in tokens.values())}
    for name, t in times.items():
        result[name] = {f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in t.items()}
    base = result["unsharded"]
    for name in times:
        if name != "unsharded":
            result[name].update({f"{k}_vs_unsharded": round(result[name][f"{k}_ms"] / base[f"{k}_ms"], 3)
                                 for k in ("prefill", "decode")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", default="", help="comma-separated larger meshes to add (e.g. 2,4)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    result = compare(args.size, args.repeats, [int(t) for t in args.tp.split(",") if t])
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
