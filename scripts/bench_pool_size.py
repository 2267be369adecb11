"""Does a step's time depend on the size of the KV pool? It must not: a step reads its own rows' blocks.

    python scripts/bench_pool_size.py --model PATH [--tp 1] [--blocks 128 60000] [--tokens 30]

For each pool size, one engine (blocks of 4, token buckets of 1 and 64 and row buckets of 1 and 8:
a lone request decodes in one-token steps, as with the engine's default buckets), a warm-up request, then one greedy request of 3 prompt tokens and ``--tokens`` output tokens:
milliseconds per output token. The smallest pool is the baseline. With ``--tp N`` on a CPU, run
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""
from __future__ import annotations

import argparse
import json
import time

from jaxengine import LLM, SamplingParams


def ms_per_token(model: str, blocks: int, tp: int, tokens: int) -> float:
    llm = LLM(model, skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=8, block_size=4,
              max_model_len=64, num_kv_blocks=blocks, token_buckets=[1, 64], request_buckets=[1, 8], progress=False,
              compile_mode="eager", tensor_parallel_size=tp)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)                  # compiles
    start = time.perf_counter()
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 60000])
    parser.add_argument("--tokens", type=int, default=30)
    args = parser.parse_args()
    rows = [{"blocks": b, "ms_per_token": round(ms_per_token(args.model, b, args.tp, args.tokens), 2)}
            for b in sorted(args.blocks)]
    for row in rows:
        row["against_smallest"] = round(row["ms_per_token"] / rows[0]["ms_per_token"], 2)
    print(json.dumps({"model": args.model, "tp": args.tp, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
