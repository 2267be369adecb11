"""Decode speed of two checkouts, alternating in fresh processes (A B B A): the default `LLM()`
with every bucket compiled, the best of two `generate` calls of 160 greedy tokens at batch 1 and
of 64 x 96 tokens at batch 64 (`ignore_eos`). Less noisy than `bench_smoke.py`'s difference of
two runs, for comparing code on one machine.

    python scripts/bench_decode_abba.py BASELINE_TREE [OTHER_TREE (default: this checkout)]
        [--quantization none]

``--quantization`` is passed to ``LLM`` (``none``: the float32 weights). Each run prints a digest
of its greedy tokens, which should agree between runs of the same arithmetic.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = """
import hashlib, json, sys, time
from jaxengine import LLM, SamplingParams
llm = LLM(progress=False, **json.loads(sys.argv[1]))
llm.wait_until_compiled()
prompts = [f"Question {i}: what is the capital of country number {i}?" for i in range(64)]
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
rates = {}
for batch, n in ((1, 160), (64, 96)):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        best = max(best, batch * n / (time.perf_counter() - start))
    rates[batch] = round(best, 1)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    rates[f"digest{batch}"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
print("RESULT", json.dumps(rates), flush=True)
"""


def measure(tree: Path, options: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(options)], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{tree}: the worker failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", type=Path)
    parser.add_argument("other", type=Path, nargs="?", default=ROOT)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    a, b = args.baseline.resolve(), args.other.resolve()
    options = {} if args.quantization is None else {"quantization": args.quantization}
    runs = {a: [], b: []}
    for tree in (a, b, b, a):
        rates = measure(tree, options)
        runs[tree].append(rates)
        print(f"{tree}: batch 1 {rates['1']} tok/s, batch 64 {rates['64']} tok/s (tokens {rates['digest1']} "
              f"{rates['digest64']})", flush=True)
    for batch in ("1", "64"):
        mean = {tree: sum(r[batch] for r in rs) / 2 for tree, rs in runs.items()}
        print(f"batch {batch}: {b} {mean[b]:.1f} tok/s against {a} {mean[a]:.1f} ({mean[b] / mean[a]:.2f}x)")


if __name__ == "__main__":
    main()
