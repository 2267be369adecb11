"""Offline throughput on the default model (SmolLM2-135M) on this CPU, against transformers
`generate` in static batches of the same requests, measured in the same run: a preset of
`python -m jaxengine.bench throughput`, and the share of the f32 matmul peak it reaches.

Workload: 64 requests, prompts uniform in 32-512 tokens, outputs uniform in 32-256 with
ignore_eos; max_model_len 1024. `--compare-sync` runs the engine with async scheduling on, off,
and on again (a sweep) instead of the baseline.

    python scripts/bench_offline.py [--requests 64] [--baseline-batch 16] [--skip-baseline] [--compare-sync]

is

    python -m jaxengine.bench throughput --num-prompts 64 --input-len 32:512 --output-len 32:256 \\
        --max-model-len 1024 --baseline hf --baseline-batch-size 16
    python -m jaxengine.bench sweep --grid async_scheduling=true,false,true throughput ...   (--compare-sync)
"""
from __future__ import annotations

import argparse
import types

from jaxengine.bench.__main__ import main as bench
from jaxengine.bench.datasets import LengthSpec, random_requests
from jaxengine.costmodel.floors import flops_per_token, matmul_gflops

INPUT_LEN, OUTPUT_LEN, MAX_MODEL_LEN = "32:512", "32:256", 1024


def workload(n: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The benchmark's prompts and output lengths (as the command line draws them)."""
    requests = random_requests(n, vocab, LengthSpec.parse(INPUT_LEN), LengthSpec.parse(OUTPUT_LEN),
                               max_model_len=MAX_MODEL_LEN)
    return [r.prompt_token_ids for r in requests], [r.output_len for r in requests]


def bench_argv(args) -> list[str]:
    throughput = ["throughput", "--num-prompts", str(args.requests), "--input-len", INPUT_LEN,
                  "--output-len", OUTPUT_LEN, "--max-model-len", str(MAX_MODEL_LEN),
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                  "--max-num-seqs", str(args.max_num_seqs)]
    if args.compare_sync:
        return ["sweep", "--grid", "async_scheduling=true,false,true", *throughput]
    if args.skip_baseline:
        return throughput
    return [*throughput, "--baseline", "hf", "--baseline-batch-size", str(args.baseline_batch)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--baseline-batch", type=int, default=16)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--compare-sync", action="store_true", help="async scheduling on, off, on again; no baseline")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    result = bench(bench_argv(p.parse_args()))
    runs = [point["result"] for point in result["points"]] if result["mode"] == "sweep" else [result]
    cfg = types.SimpleNamespace(**runs[0]["model"]["config"])
    peak = matmul_gflops() * 1e9 / flops_per_token(cfg)      # tokens/s if only the matmuls ran
    for run in runs:
        tok_s = run["metrics"]["output_tokens_per_s"]
        print(f"{tok_s:.1f} output tok/s: {tok_s / peak:.1%} of the f32 matmul peak ({peak:.0f} tok/s)")


if __name__ == "__main__":
    main()
