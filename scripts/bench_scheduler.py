"""Host cost of the engine loop (schedule + update + the step's bookkeeping) with a fake runner
and no device work, with prefix caching on (the default) and off, async scheduling on and off.

Workload: 1024 requests, prompt and output lengths uniform in 100-1024 (ignore_eos),
max_num_seqs 512, max_num_batched_tokens 16384, 8192 blocks, token 1 always sampled; block
size 256 (everything fits), then 16 (a quarter of the working set fits: preemption by
recompute). The fake runner's own time is excluded. Prints us/step and us/scheduled request per
configuration, a minimal-loop baseline measured in the same run, and one JSON line per row.

    python scripts/bench_scheduler.py [--requests 1024] [--repeats 3] [--profile out.html]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

from jaxengine import EngineConfig, SamplingParams
from jaxengine.engine import Engine
from jaxengine.testing.fake_runner import ConstantRunner

CONFIGS = [  # (block size, prefix caching, async scheduling)
    (256, True, False), (256, True, True), (256, False, False), (256, False, True), (16, True, False),
]


class TimedRunner(ConstantRunner):
    """The fake runner, timing itself so that its cost can be taken out of the loop's."""

    def __init__(self) -> None:
        super().__init__(token=1)
        self.seconds = 0.0

    def execute(self, out):
        t0 = time.perf_counter()
        result = super().execute(out)
        self.seconds += time.perf_counter() - t0
        return result


def make_engine(block_size: int, caching: bool, async_scheduling: bool, num_requests: int,
                seed: int = 0) -> Engine:
    cfg = EngineConfig().replace(block_size=block_size, num_gpu_blocks=8192, max_num_seqs=512,
                                 max_num_batched_tokens=16384, max_model_len=4096,
                                 enable_prefix_caching=caching)
    engine = Engine(cfg, TimedRunner(), async_scheduling=async_scheduling, clock=lambda: 0.0)
    rng = random.Random(seed)
    for i in range(num_requests):
        prompt = [rng.randrange(2, 32000) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(100, 1024), ignore_eos=True))
    return engine


def run_loop(engine: Engine) -> dict:
    steps = scheduled = 0
    gc.disable()   # the loop allocates little; collections would only add noise
    try:
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            scheduled += len(engine.last_output.seq_ids)
        host_s = time.perf_counter() - t0 - engine.runner.seconds
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
        engine = make_engine(256, True, False, args.requests)
        with Profiler(interval=0.0005) as profiler:
            run_loop(engine)
        profiler.write_html(args.profile)
        print(profiler.output_text(unicode=False, color=False, show_all=False))
        return
    base = min((minimal_loop(256, args.requests) for _ in range(args.repeats)),
               key=lambda r: r["us_per_scheduled_request"])
    print(f"baseline (minimal loop, same run): {base['us_per_scheduled_request']:.3f} us/scheduled request")
    for block_size, caching, async_scheduling in CONFIGS:
        runs = [run_loop(make_engine(block_size, caching, async_scheduling, args.requests))
                for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["us_per_scheduled_request"])
        ratio = best["us_per_scheduled_request"] / base["us_per_scheduled_request"]
        print(f"block_size={block_size:4d} prefix_caching={'on ' if caching else 'off'} "
              f"async={'on ' if async_scheduling else 'off'}: {best['us_per_step']:8.1f} us/step  "
              f"{best['us_per_scheduled_request']:.3f} us/scheduled request ({ratio:.1f}x the baseline; "
              f"{best['steps']} steps, {best['scheduled_requests']} scheduled requests, best of {args.repeats})")
        print(json.dumps({"block_size": block_size, "prefix_caching": caching, "async_scheduling": async_scheduling,
                          **{k: round(v, 4) if isinstance(v, float) else v for k, v in best.items()}}))


if __name__ == "__main__":
    main()
