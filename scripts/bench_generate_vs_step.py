"""The default model's batch-1 ``generate`` against its step executable alone, in one process and
in alternation (this machine's speed drifts by tens of percent over minutes; the difference of
two runs minutes apart says little), then the host's parts of a step.

    python scripts/bench_generate_vs_step.py [--tokens 256] [--reps 4]

Each repetition: one ``generate`` of ``--tokens`` tokens from a ~80-token prompt (ms a token),
then the step executable launched ``--tokens`` times back to back on one captured step's inputs
(what the device part of a token costs, launches overlapped as under async scheduling). Prints
both medians and their difference: the host's time the step does not hide. Then one more
``generate`` with a timer around each host part of the engine's loop (ms a token): scheduling,
building the inputs, the launch, the wait for the result, recording the tokens, output processing.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import jax
import numpy as np

PROMPT = "Question: what is the capital of France? " * 8


def timed(acc: dict, owner, name: str) -> None:
    """Wrap ``owner.name`` to add its time to ``acc[name]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - start
    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    from jaxengine import LLM, SamplingParams
    from jaxengine.core.scheduler import Scheduler
    from jaxengine.output_processor import OutputProcessor
    from jaxengine.runner.input_batch import InputBatch
    from jaxengine.runner.model_runner import ModelRunner

    llm = LLM(progress=False)
    llm.wait_until_compiled()
    runner = llm.engine.runner
    run, seen = runner._run, {}

    def capture(inputs):
        seen["inputs"] = inputs
        return run(inputs)

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    runner._run = capture
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=args.tokens // 2, ignore_eos=True), use_tqdm=False)
    runner._run = run
    inputs = seen["inputs"]
    print(f"context {int(np.asarray(inputs.attention.seq_lens)[0])}, {args.tokens} tokens a repetition")
    generate, step = [], []
    for rep in range(args.reps):
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        generate.append((time.perf_counter() - start) / args.tokens)
        for _ in range(3):
            jax.block_until_ready(run(inputs))
        start = time.perf_counter()
        for _ in range(args.tokens):
            result = run(inputs)
        jax.block_until_ready(result)
        step.append((time.perf_counter() - start) / args.tokens)
        print(f"repetition {rep}: generate {generate[-1] * 1e3:.2f} ms a token, step executable {step[-1] * 1e3:.2f} ms",
              flush=True)
    g, s = np.median(generate), np.median(step)
    print(f"median: generate {g * 1e3:.2f} ms a token ({1 / g:.1f} tok/s), step executable {s * 1e3:.2f} ms; "
          f"host time not hidden {(g - s) * 1e3:.2f} ms ({(g - s) / g:.0%})")

    acc: dict[str, float] = collections.defaultdict(float)
    for owner, names in ((Scheduler, ("schedule", "update_from_output")), (InputBatch, ("prepare", "record_samples")),
                         (ModelRunner, ("launch", "_collect")), (OutputProcessor, ("process",))):
        for name in names:
            timed(acc, owner, name)
    wait = runner.device_wait_s
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    total = time.perf_counter() - start
    acc["_collect"] -= runner.device_wait_s - wait
    parts = {"schedule": "scheduling", "prepare": "building the inputs", "launch": "the launch",
             "_collect": "reading the result (less the wait; recording included)",
             "record_samples": "  of which recording the tokens",
             "update_from_output": "the scheduler's update", "process": "output processing"}
    print(f"one generate, host parts (ms a token; the whole {total / args.tokens * 1e3:.2f}, the wait for results "
          f"{(runner.device_wait_s - wait) / args.tokens * 1e3:.2f}):")
    for name, what in parts.items():
        print(f"  {what}: {acc[name] / args.tokens * 1e3:.3f}")


if __name__ == "__main__":
    main()
