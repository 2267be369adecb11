"""Offline throughput with LoRA adapters against the base model alone, and the cost of loading one.

    python scripts/bench_lora.py [--model PATH] [--requests 64] [--input-len 128] [--output-len 64]
                                 [--repeats 2] [--out bench_results/lora.json]

One engine without LoRA (the baseline) and one with ``enable_lora`` (``max_loras=8``,
``max_lora_rank=16``), the same defaults otherwise, on the default model unless ``--model``.
Rank-16 PEFT adapters on every target (q/k/v/o, gate/up/down) with random weights are written to
a temporary folder. Greedy requests (random prompt ids, ``ignore_eos``) run on the baseline, on
the LoRA engine with no adapter, and with 1, 4 and 8 adapters given round-robin; each
configuration ``--repeats`` times, interleaved, the median reported. Every run has prompts of its
own (the same lengths), so no run finds another's prompts in the prefix cache. Then the cost of one
adapter load at runtime: the read and check of its folder (``LLM.load_lora``) and the write of
its weights into a device slot.

``--decode-step``: instead, the model's decode step alone at ``--rows`` rows (160 tokens of
context), without LoRA slots and with 8 rank-16 slots holding random adapters, the rows on none,
1 or 8 of them; medians of 25 interleaved repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxengine import LLM, LoRARequest, SamplingParams
from jaxengine.models.lora_weights import module_shapes

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, model_config, rank: int, seed: int, std: float = 0.02) -> Path:
    """A PEFT LoRA folder of ``rank`` on every target with random A and B (B non-zero)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (d_in, d_out) in module_shapes(model_config).items():
            kind = "self_attn" if module in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * std).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * std).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGETS)}))
    return folder


def throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list | None) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    tokens = sum(len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outputs))
    return {"seconds": seconds, "tok_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_results/lora.json")
    parser.add_argument("--decode-step", action="store_true")
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    if args.decode_step:
        result = decode_step(args.model, args.rows)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return

    base = LLM(args.model, progress=False, compile_mode="eager")
    lora = LLM(args.model, progress=False, compile_mode="eager", enable_lora=True, max_loras=8, max_lora_rank=16)
    folder = Path(tempfile.mkdtemp(prefix="jaxengine-lora-bench-"))
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(write_random_adapter(folder / f"a{i}", lora.model_config,
                                                                              16, seed=i)))
                for i in range(8)]
    seeds = iter(range(1 << 20))

    def fresh_prompts(n: int) -> list[list[int]]:
        rng = np.random.default_rng(next(seeds))
        return [rng.integers(1, lora.model_config.vocab_size, args.input_len).tolist() for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    runs = {"base model, no LoRA": (base, None), "LoRA engine, no adapter": (lora, None)}
    for k in (1, 4, 8):
        runs[f"{k} adapter{'s' if k > 1 else ''}"] = (lora, [adapters[i % k] for i in range(args.requests)])
    for llm, loras in runs.values():                   # warm: every adapter read, every bucket touched
        throughput(llm, fresh_prompts(8), params, None if loras is None else loras[:8])
    samples = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (llm, loras) in runs.items():
            samples[name].append(throughput(llm, fresh_prompts(args.requests), params, loras)["tok_s"])
            print(f"{name}: {samples[name][-1]:.1f} tok/s", flush=True)
    baseline = statistics.median(samples["base model, no LoRA"])
    table = {name: {"tok_s": round(statistics.median(s), 1), "runs": [round(x, 1) for x in s],
                    "overhead_vs_base": round(1 - statistics.median(s) / baseline, 3)} for name, s in samples.items()}
    result = {"device": str(jax.devices()[0]), "model": str(lora.model_path), "requests": args.requests,
              "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
              "throughput": table, "load": load_cost(lora, folder)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def load_cost(llm: LLM, folder: Path, repeats: int = 5) -> dict:
    """One adapter loaded at runtime: its folder read and checked, then written into a slot."""
    slots = llm.runner.lora
    reads, writes = [], []
    for i in range(repeats):
        path = write_random_adapter(folder / f"load{i}", llm.model_config, 16, seed=100 + i)
        start = time.perf_counter()
        request = llm.load_lora(f"load-{i}", str(path))
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        adapter = slots.host[request.lora_int_id]                # what the request would keep
        llm.runner.state, _ = slots.activate(llm.runner.state, [adapter])       # what a step's launch does
        jax.block_until_ready(llm.runner.state)
        writes.append(time.perf_counter() - start)
        llm.remove_lora(f"load-{i}")
    size = (folder / "load0" / "adapter_model.safetensors").stat().st_size
    return {"adapter_mib": round(size / (1 << 20), 1), "read_ms": round(statistics.median(reads) * 1e3, 1),
            "slot_write_ms": round(statistics.median(writes) * 1e3, 1)}


def decode_step(model: str | None, rows: int, context: int = 160, block: int = 16, repeats: int = 25) -> dict:
    """The model's decode step (its forward and logits) at ``rows`` rows: without LoRA slots, and
    with 8 slots of rank 16 holding random weights, the rows on no adapter, on 1, on 8."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    from jaxengine.default_model import default_model_path
    from jaxengine.kernels.paged_attention import AttentionMetadata
    from jaxengine.models.forward import make_forward
    from jaxengine.models.llama import init_kv_caches
    from jaxengine.models.lora_weights import attach_lora, lora_rows
    from jaxengine.models.weights import load_model

    loaded, cfg = load_model(Path(model) if model else default_model_path(False), jnp.float32)
    attach_lora(loaded, 8, 16, jnp.float32)
    for path, variable in nnx.to_flat_state(nnx.state(loaded)):
        if len(path) > 1 and path[-2] == "lora":
            variable[...] = jax.random.normal(jax.random.PRNGKey(len(path[-1])), variable[...].shape) * 0.01
    state, forward = make_forward(loaded)
    pages = -(-(context + 1) // block)
    caches = init_kv_caches(cfg, 1 + rows * pages, block, jnp.float32)
    md = AttentionMetadata.build([(context, 1, list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(rows)],
                                 block, num_tokens=rows, max_blocks=pages, num_rows=rows)
    cases = {"no LoRA slots": md}
    for name, k in (("slots, no adapter", 0), ("1 adapter", 1), ("8 adapters", 8)):
        order, sizes, inverse = lora_rows((np.arange(rows) % k if k else np.full(rows, -1)).astype(np.int32), 8, rows)
        cases[name] = dataclasses.replace(md, lora_order=jnp.asarray(order), lora_sizes=jnp.asarray(sizes),
                                          lora_inverse=jnp.asarray(inverse))
    ids, wanted = jnp.zeros(rows, jnp.int32), jnp.arange(rows)
    times = {name: [] for name in cases}
    for _ in range(repeats + 1):                        # the first round compiles
        for name, case in cases.items():
            start = time.perf_counter()
            caches, logits = forward(state, caches, ids, case, wanted)
            logits.block_until_ready()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["no LoRA slots"][1:])
    return {"device": str(jax.devices()[0]), "rows": rows, "context": context,
            "step_ms": {name: round(statistics.median(t[1:]) * 1e3, 1) for name, t in times.items()},
            "overhead": {name: round(statistics.median(t[1:]) / base - 1, 3) for name, t in times.items()}}


if __name__ == "__main__":
    main()
