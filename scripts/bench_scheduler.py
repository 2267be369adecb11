"""Host cost of the scheduling loop (schedule + update) with a fake runner and no device work.

Workload (issue 2): 1024 requests, prompt and output lengths uniform in 100-1024 (ignore_eos),
max_num_seqs 512, max_num_batched_tokens 16384, 8192 blocks, token 1 always sampled; block
size 256, then 16. Prints us/step and us/scheduled request for both and ends with one JSON
line for the block-size-256 run.

    python scripts/bench_scheduler.py [--requests 1024] [--profile out.html]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

from jaxengine import EngineConfig, SamplingParams
from jaxengine.core.scheduler import Scheduler
from jaxengine.request import Request
from jaxengine.runner.fake_runner import ConstantRunner


def make_scheduler(block_size: int, num_requests: int, seed: int = 0) -> Scheduler:
    cfg = EngineConfig().replace(block_size=block_size, num_gpu_blocks=8192, max_num_seqs=512,
                                 max_num_batched_tokens=16384, max_model_len=4096,
                                 enable_prefix_caching=False)
    scheduler = Scheduler(cfg.scheduler, cfg.cache)
    rng = random.Random(seed)
    for i in range(num_requests):
        prompt = [rng.randrange(2, 32000) for _ in range(rng.randint(100, 1024))]
        params = SamplingParams(max_tokens=rng.randint(100, 1024), ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, params, arrival_time=0.0))
    return scheduler


def run_loop(scheduler: Scheduler) -> dict:
    runner = ConstantRunner(token=1)
    steps = scheduled = 0
    host_s = 0.0
    gc.disable()   # the loop allocates little; collections would only add noise
    try:
        while scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            out = scheduler.schedule()
            t1 = time.perf_counter()
            result = runner.execute(out)
            t2 = time.perf_counter()
            scheduler.update_from_output(out, result)
            host_s += (t1 - t0) + (time.perf_counter() - t2)
            steps += 1
            scheduled += len(out.seq_ids)
    finally:
        gc.enable()
    return {"us_per_step": host_s / steps * 1e6, "us_per_scheduled_request": host_s / scheduled * 1e6,
            "steps": steps, "scheduled_requests": scheduled}


def minimal_loop(block_size: int, num_requests: int, seed: int = 0) -> dict:
    """Baseline: a scheduler that does much less (no KV blocks, no budget, no queues to speak
    of): admit up to max_num_seqs, give each running request one token, append, retire."""
    rng = random.Random(seed)
    todo = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(num_requests)]
    todo.reverse()
    running: list[list] = []
    steps = scheduled = 0
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < 512:
            prompt_len, max_tokens = todo.pop()
            running.append([prompt_len, 0, max_tokens, []])
        rows = [(r, 1) for r in running]
        for r, _ in rows:
            r[3].append(1)
            r[1] += 1
        running = [r for r in running if r[1] < r[2]]
        steps += 1
        scheduled += len(rows)
    host_s = time.perf_counter() - t0
    return {"us_per_step": host_s / steps * 1e6, "us_per_scheduled_request": host_s / scheduled * 1e6,
            "steps": steps, "scheduled_requests": scheduled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--profile", help="write a pyinstrument HTML profile of one block-size-256 run")
    args = parser.parse_args()
    if args.profile:
        from pyinstrument import Profiler
        scheduler = make_scheduler(256, args.requests)
        with Profiler(interval=0.0005) as profiler:
            run_loop(scheduler)
        profiler.write_html(args.profile)
        print(profiler.output_text(unicode=False, color=False, show_all=False))
        return
    results = {}
    for block_size in (256, 16):
        runs = [run_loop(make_scheduler(block_size, args.requests)) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["us_per_scheduled_request"])
        results[block_size] = best
        print(f"block_size={block_size:4d}: {best['us_per_step']:8.1f} us/step  "
              f"{best['us_per_scheduled_request']:.3f} us/scheduled request  "
              f"({best['steps']} steps, {best['scheduled_requests']} scheduled requests, best of {args.repeats})")
    base = min((minimal_loop(256, args.requests) for _ in range(args.repeats)),
               key=lambda r: r["us_per_scheduled_request"])
    ratio = results[256]["us_per_scheduled_request"] / base["us_per_scheduled_request"]
    print(f"baseline (minimal loop, same run): {base['us_per_scheduled_request']:.3f} us/scheduled request; "
          f"jaxengine at block_size=256 costs {ratio:.2f}x the baseline")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results[256].items()}))


if __name__ == "__main__":
    main()
