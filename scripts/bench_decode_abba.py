"""Decode speed of two checkouts, alternating in fresh processes (A B B A, then A B B A again for
``--pairs 4``): the default `LLM()` with every bucket compiled, the best of ``--calls`` (2)
`generate` calls of 160 greedy tokens at batch 1 and of 96 tokens at the other batches (1 and 64
unless ``--batches`` says; `ignore_eos`). Less noisy than `bench_smoke.py`'s difference of two
runs, for comparing code on one machine.

    python scripts/bench_decode_abba.py BASELINE_TREE [OTHER_TREE (default: this checkout)]
        [--quantization none] [--batches 1,64] [--calls 2] [--pairs 2]

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
options, batches, calls = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(progress=False, **options)
llm.wait_until_compiled()
prompts = [f"Question {i}: what is the capital of country number {i}?" for i in range(64)]
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
rates = {}
for batch in batches:
    n = 160 if batch == 1 else 96
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    best = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        best = max(best, batch * n / (time.perf_counter() - start))
    rates[batch] = round(best, 1)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    rates[f"digest{batch}"] = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
print("RESULT", json.dumps(rates), flush=True)
"""


def measure(tree: Path, options: dict, batches: list[int], calls: int) -> dict:
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(options), json.dumps(batches), str(calls)], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
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
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes, at most 64")
    parser.add_argument("--calls", type=int, default=2, help="generate calls per batch in each process (the best counts)")
    parser.add_argument("--pairs", type=int, default=2, help="processes per checkout, in A B B A order")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not all(1 <= b <= 64 for b in batches) or args.calls < 1 or args.pairs < 1:
        parser.error("batches must be 1..64, --calls and --pairs at least 1")
    a, b = args.baseline.resolve(), args.other.resolve()
    options = {} if args.quantization is None else {"quantization": args.quantization}
    runs = {a: [], b: []}
    order = [(a, b) if i % 2 == 0 else (b, a) for i in range(args.pairs)]
    for tree in [t for pair in order for t in pair]:
        rates = measure(tree, options, batches, args.calls)
        runs[tree].append(rates)
        print(f"{tree}: " + ", ".join(f"batch {n} {rates[str(n)]} tok/s" for n in batches)
              + " (tokens " + " ".join(rates[f"digest{n}"] for n in batches) + ")", flush=True)
    for batch in map(str, batches):
        mean = {tree: sum(r[batch] for r in rs) / len(rs) for tree, rs in runs.items()}
        print(f"batch {batch}: {b} {mean[b]:.1f} tok/s against {a} {mean[a]:.1f} ({mean[b] / mean[a]:.2f}x)")


if __name__ == "__main__":
    main()
