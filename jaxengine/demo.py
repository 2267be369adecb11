"""Offline demo: the default model (SmolLM2-135M-Instruct) answers a few
chat prompts through the whole engine; with ``--fake``, a synthetic workload runs through the real
scheduler and KV cache manager with the KV-simulating fake runner instead.

    python -m jaxengine.demo [--model PATH] [--fake [--requests 200] [--num-gpu-blocks 512] ...]
"""
from __future__ import annotations

import argparse
import random
import time

from tqdm.auto import tqdm

from jaxengine.config import EngineConfig
from jaxengine.core.policy import POLICIES
from jaxengine.engine import Engine
from jaxengine.testing.fake_runner import HashRunner
from jaxengine.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--fake", action="store_true", help="scheduler-only demo with the fake runner")
    p.add_argument("--requests", type=int, default=200, help="number of requests (--fake)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=512, help="device KV pool (small: forces preemption)")
    p.add_argument("--num-cpu-blocks", type=int, default=256, help="host pool for swapped groups")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto")
    p.add_argument("--scheduling-policy", choices=list(POLICIES), default="fcfs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "What is 12 times 12?"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.fake:
        fake_demo(args)
    else:
        model_demo(args)


def model_demo(args: argparse.Namespace) -> None:
    from jaxengine.llm import LLM

    llm = LLM(args.model, max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1024)
    llm.wait_until_compiled()           # the speed printed below is the compiled engine's
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                       SamplingParams(temperature=0, max_tokens=64))
    seconds = time.perf_counter() - start
    for q, o in zip(QUESTIONS, outputs):
        print(f"\n> {q}\n{o.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s on {len(QUESTIONS)} requests)")


def fake_demo(args: argparse.Namespace) -> None:
    cfg = EngineConfig().replace(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                                 num_cpu_blocks=args.num_cpu_blocks, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 preemption_mode=args.preemption_mode, policy=args.scheduling_policy)
    engine = Engine(cfg, HashRunner(args.num_gpu_blocks, args.num_cpu_blocks, args.block_size), trace=True)
    rng = random.Random(args.seed)
    system_prompt = [rng.randrange(1000) for _ in range(64)]    # shared: prefix-cache hits
    for i in range(args.requests):
        prompt = system_prompt + [rng.randrange(1000) for _ in range(rng.randint(8, 256))]
        params = SamplingParams(max_tokens=rng.randint(16, 256), n=rng.choice([1, 1, 1, 2]), ignore_eos=True)
        engine.add_request(f"req-{i}", prompt, params, priority=rng.randint(0, 2))
    start = time.perf_counter()
    with tqdm(total=args.requests, desc="requests", unit="req") as bar:
        while engine.has_unfinished_requests():
            bar.update(len(engine.step()))
    print_summary(engine, time.perf_counter() - start)


def print_summary(engine: Engine, seconds: float) -> None:
    traces, kv = engine.traces, engine.scheduler.kv
    decode = sum(t.num_decode_tokens for t in traces)
    prefill = sum(t.num_prefill_tokens for t in traces)
    print(f"steps                 {len(traces)}  ({seconds * 1e6 / max(len(traces), 1):.0f} us/step on the host)")
    print(f"tokens                {prefill} prefill + {decode} decode")
    print(f"preemptions           {sum(t.num_preemptions for t in traces)}")
    print(f"blocks swapped        {sum(t.num_blocks_swapped_out for t in traces)} out, "
          f"{sum(t.num_blocks_swapped_in for t in traces)} in")
    print(f"peak KV usage         {max(t.kv_usage for t in traces):.0%}")
    queries = max(kv.prefix_cache_queries, 1)
    print(f"prefix cache          {kv.prefix_cache_hits} of {kv.prefix_cache_queries} prompt tokens hit "
          f"({kv.prefix_cache_hits / queries:.0%})")


if __name__ == "__main__":
    main()
