"""What scoring a prompt costs (prompt logprobs, as ``echo`` with ``logprobs`` asks for them)
against a plain prefill of the same prompts, on the default model, on the CPU.

    python scripts/bench_prompt_logprobs.py [--prompts 16] [--length 256] [--repeats 3] [--json PATH]

Each round generates one token for every prompt, once plainly and once with
``prompt_logprobs=1``. The prefix cache is off, so both compute every prompt token (a request
that asks for prompt logprobs never takes a cache hit). The prompts are random token ids. The
rounds alternate and the median of each is reported, with the seconds per prompt token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxengine import LLM, SamplingParams
from jaxengine.default_model import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    llm = LLM(str(default_model_path()), enable_prefix_caching=False, max_model_len=args.length + 16)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.length).tolist()} for _ in range(args.prompts)]
    modes = {"plain prefill": SamplingParams(max_tokens=1, temperature=0),
             "prompt logprobs": SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)}
    llm.generate(prompts[:2], modes["prompt logprobs"], use_tqdm=False)        # warm both paths
    llm.generate(prompts[:2], modes["plain prefill"], use_tqdm=False)
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, params in modes.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            if params.prompt_logprobs is not None:
                assert all(len(o.prompt_logprobs) == args.length for o in outputs)
    tokens = args.prompts * args.length
    result = {name: {"seconds": round(statistics.median(s), 3),
                     "ms_per_prompt_token": round(1e3 * statistics.median(s) / tokens, 4)} for name, s in seconds.items()}
    result["ratio"] = round(result["prompt logprobs"]["seconds"] / result["plain prefill"]["seconds"], 3)
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
