"""Offline throughput on the default model (SmolLM2-135M) on this CPU, against transformers
`generate` in static batches of the same requests, measured in the same run.

Workload: 64 requests, prompts uniform in 32-512 tokens, outputs uniform in 32-256 with
ignore_eos. Output tokens/s counts the tokens each request asked for.

    python scripts/bench_offline.py [--requests 64] [--baseline-batch 16] [--skip-baseline]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
from bench_model import flops_per_token, matmul_gflops

from jaxengine import LLM, SamplingParams


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    outputs = [rng.randint(32, 256) for _ in range(n)]
    return prompts, outputs


def run_engine(llm: LLM, prompts, outputs, async_scheduling: bool = True) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.engine.async_scheduling = async_scheduling
    llm.engine.scheduler.kv.reset_prefix_cache()       # repeated runs must not hit the earlier run's prompts
    llm.engine.traces = []
    runner = llm.runner
    runner.device_wait_s = runner.idle_s = 0.0
    runner.num_launches = runner.num_idle_launches = 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    host = seconds - runner.device_wait_s          # host time not spent waiting for results
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs)
    traces = llm.engine.traces
    return {"async_scheduling": async_scheduling, "seconds": seconds, "output_tokens": produced,
            "tok_per_s": produced / seconds, "steps": len(traces),
            "prefill_tokens": sum(t.num_prefill_tokens for t in traces),
            "preemptions": sum(t.num_preemptions for t in traces), "host_s": host,
            "host_ms_per_step": host / len(traces) * 1e3,
            "idle_launch_fraction": runner.num_idle_launches / max(runner.num_launches, 1),
            "device_idle_s": runner.idle_s, "device_idle_fraction": runner.idle_s / seconds}


def run_transformers(path, prompts, outputs, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group, lens = prompts[i:i + batch], outputs[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])          # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
                           pad_token_id=0)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "output_tokens": sum(outputs), "tok_per_s": sum(outputs) / seconds, "batch": batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--baseline-batch", type=int, default=16)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--compare-sync", action="store_true", help="also run with async scheduling off")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=1024, progress=False)
    startup = time.perf_counter() - t0
    prompts, outputs = workload(args.requests, llm.model_config.vocab_size)
    engine = run_engine(llm, prompts, outputs)
    peak = matmul_gflops() * 1e9 / flops_per_token(llm.model_config)      # tokens/s if only matmuls ran
    print(f"jaxengine: {engine['tok_per_s']:.1f} output tok/s ({engine['output_tokens']} tokens in "
          f"{engine['seconds']:.1f} s, {engine['steps']} steps; start-up {startup:.1f} s); the f32 matmul "
          f"peak allows {peak:.0f} tok/s: {engine['tok_per_s'] / peak:.1%} of it")
    result = {"engine": engine, "startup_s": startup, "matmul_peak_tok_per_s": peak}
    if args.compare_sync:      # async, sync, async again: the order's effect shows
        result["engine_sync"] = run_engine(llm, prompts, outputs, async_scheduling=False)
        result["engine_again"] = run_engine(llm, prompts, outputs)
    for run in filter(None, (engine, result.get("engine_sync"), result.get("engine_again"))):
        print(f"async_scheduling={run['async_scheduling']}: {run['tok_per_s']:.1f} tok/s; host work "
              f"{run['host_ms_per_step']:.2f} ms/step; {run['idle_launch_fraction']:.1%} of steps launched onto "
              f"an idle device; device idle {run['device_idle_s']:.2f} s ({run['device_idle_fraction']:.2%})")
    if not args.skip_baseline:
        base = run_transformers(llm.model_path, prompts, outputs, args.baseline_batch)
        print(f"transformers generate, static batches of {base['batch']}: {base['tok_per_s']:.1f} output tok/s "
              f"({base['seconds']:.1f} s)")
        print(f"ratio: {engine['tok_per_s'] / base['tok_per_s']:.2f}x")
        result["baseline"] = base
    print(json.dumps(result))


if __name__ == "__main__":
    main()
