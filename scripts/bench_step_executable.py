"""The default model's compiled decode step alone, as the engine launches it: one batch-1 step
(context ~138) captured from ``LLM()``, then launched again and again with the same inputs (the
KV cache donated and taken back, as the runner does), waiting for each. No scheduling, no
sampling bookkeeping: the executable's own time, the figure a kernel change moves.

    python scripts/bench_step_executable.py [--calls 200]

Prints the median and 10th percentile of ``--calls`` steps, inputs passed as the runner passes
them (host arrays) and already on the device, and the launch alone (the host's part).
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    from jaxengine import LLM, SamplingParams

    llm = LLM(progress=False, async_scheduling=False)
    llm.wait_until_compiled()
    runner = llm.engine.runner
    seen = {}
    run = runner._run

    def capture(inputs):
        seen["inputs"] = inputs
        return run(inputs)

    runner._run = capture
    llm.generate(["Question 1: what is the capital?"], SamplingParams(temperature=0, max_tokens=130, ignore_eos=True),
                 use_tqdm=False)
    runner._run = run
    inputs = seen["inputs"]
    print(f"bucket {inputs.bucket}, context {int(np.asarray(inputs.attention.seq_lens)[0])}")
    for name, given in (("host inputs", inputs), ("device inputs", jax.device_put(inputs))):
        for _ in range(5):
            jax.block_until_ready(run(given))
        steps, launches = [], []
        for _ in range(args.calls):
            start = time.perf_counter()
            result = run(given)
            launched = time.perf_counter()
            jax.block_until_ready(result)
            steps.append(time.perf_counter() - start)
            launches.append(launched - start)
        steps.sort()
        print(f"{name}: step median {steps[len(steps) // 2] * 1e3:.2f} ms, p10 {steps[len(steps) // 10] * 1e3:.2f} ms; "
              f"launch median {sorted(launches)[len(launches) // 2] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
