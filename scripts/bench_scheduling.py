"""Scheduling features on the default model (SmolLM2-135M), on this CPU, each against itself with
the feature off, in the same run.

prefix: 64 requests sharing a 1,024-token prefix + 32 unique tokens, 32 output tokens each:
        prefill tokens computed and output tokens/s, prefix caching on vs off; a preset of
        python -m jaxengine.bench sweep --grid enable_prefix_caching=false,true throughput \
            --dataset shared-prefix --prefix-len 1024 --input-len 32 --output-len 32 --num-prompts 64 \
            --max-model-len 2048
itl:    8 requests decode; then 8 prompts of 2,048 tokens arrive: p99 inter-token latency of the
        8 decoding requests with chunked prefill (budget 512) vs without (budget 2,048 + 64).

    python scripts/bench_scheduling.py prefix|itl|all
"""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from jaxengine import LLM, SamplingParams
from jaxengine.bench.__main__ import main as bench


PREFIX_SWEEP = ["sweep", "--grid", "enable_prefix_caching=false,true", "throughput", "--dataset", "shared-prefix",
                "--prefix-len", "1024", "--input-len", "32", "--output-len", "32", "--num-prompts", "64",
                "--max-num-batched-tokens", "512", "--max-num-seqs", "64", "--max-model-len", "2048"]


def prefix_runs() -> tuple[dict, dict]:
    """(caching off, caching on): seconds, output tok/s, prefill tokens computed, cached tokens."""
    runs = [point["result"]["metrics"] for point in bench(PREFIX_SWEEP)["points"]]
    return tuple({"seconds": m["elapsed_s"], "tok_per_s": m["output_tokens_per_s"],
                  "prefill_tokens": m["prefill_tokens"], "cached_tokens": m["cached_prompt_tokens"]} for m in runs)


def itl_run(chunked: bool) -> dict:
    budget = 512 if chunked else 2048 + 64
    llm = LLM(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=2304, enable_chunked_prefill=chunked,
              enable_prefix_caching=False, progress=False)
    engine, rng = llm.engine, random.Random(1)
    decoders = [engine.add_request(f"d{i}", [rng.randrange(100, 40000) for _ in range(64)],
                                   SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)) for i in range(8)]
    for _ in range(4):                                       # the 8 are decoding
        engine.step()
    for i in range(8):
        engine.add_request(f"p{i}", [rng.randrange(100, 40000) for _ in range(2048)],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    last = {r.request_id: (time.perf_counter(), r.seqs[0].num_tokens) for r in decoders}
    gaps = []
    while any(not r.is_finished for r in decoders):
        engine.step()
        now = time.perf_counter()
        for r in decoders:
            t, n = last[r.request_id]
            if r.seqs[0].num_tokens > n:
                gaps.append(now - t)
                last[r.request_id] = (now, r.seqs[0].num_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    return {"chunked": chunked, "budget": budget, "itl_p50_ms": float(np.percentile(gaps, 50) * 1e3),
            "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3), "itl_max_ms": float(max(gaps) * 1e3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", choices=["prefix", "itl", "all"])
    args = p.parse_args()
    result = {}
    if args.which in ("prefix", "all"):
        off, on = prefix_runs()
        result["prefix"] = {"off": off, "on": on,
                            "prefill_drop": 1 - on["prefill_tokens"] / off["prefill_tokens"],
                            "speedup": on["tok_per_s"] / off["tok_per_s"]}
        print(f"prefix caching: prefill tokens {off['prefill_tokens']} -> {on['prefill_tokens']} "
              f"(-{result['prefix']['prefill_drop']:.1%}); {off['tok_per_s']:.1f} -> {on['tok_per_s']:.1f} "
              f"output tok/s ({result['prefix']['speedup']:.2f}x)")
    if args.which in ("itl", "all"):
        whole, chunked = itl_run(False), itl_run(True)
        result["itl"] = {"unchunked": whole, "chunked": chunked, "p99_ratio": chunked["itl_p99_ms"] / whole["itl_p99_ms"]}
        print(f"ITL p99 of running decodes while 2,048-token prompts arrive: {whole['itl_p99_ms']:.0f} ms without "
              f"chunked prefill, {chunked['itl_p99_ms']:.0f} ms with ({result['itl']['p99_ratio']:.2f}x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
