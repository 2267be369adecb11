"""Serving presets of ``python -m jaxengine.bench``: the server is launched for each level
(``serve --launch``, a process of its own, every step bucket compiled before the load starts);
prompts are random token ids of a fixed length and outputs fixed with ``ignore_eos``, so every
level does the same work.

Rates (the default model, Poisson arrivals)::

    python scripts/bench_serving.py [--rates 0.5,2] [--requests 48]

is ``python -m jaxengine.bench sweep --grid request_rate=0.5,2 serve --launch --num-prompts 48
--input-len 128 --token-ids 100 40000 --output-len 64 --ignore-eos --max-model-len 1024``.

``--sweep`` measures degradation under overload instead: closed-loop clients (each sends its next
request when its last one ends) at concurrency 1, 2, 4, ... up to ``--max-concurrency``, 4
requests per client and at least 32 per level (one linked grid axis,
``max_concurrency+num_prompts``). ``--tiny`` serves the tests' tiny random Llama (built with
transformers, the test extra) instead of the default model::

    python scripts/bench_serving.py --sweep --tiny

Options after ``--`` go to the bench command (e.g. ``-- --plot docs/bench/serving``).
"""
from __future__ import annotations

import argparse
import json
import tempfile

from tiny_checkpoint import tiny_checkpoint

from jaxengine.bench.__main__ import main as bench

LOAD = ["--input-len", "128", "--output-len", "64", "--ignore-eos", "--max-model-len", "1024"]


def concurrency_axis(max_concurrency: int, per_client: int = 4, least: int = 32) -> str:
    levels = [1 << i for i in range(max_concurrency.bit_length()) if 1 << i <= max_concurrency]
    return "max_concurrency+num_prompts=" + ",".join(f"{c}+{max(per_client * c, least)}" for c in levels)


def summary(result: dict) -> dict:
    """Throughput at the highest level relative to the peak level's."""
    points = [(p["params"], p["result"]["output_throughput"], p["result"]["failed"]) for p in result["points"]]
    peak, last = max(points, key=lambda p: p[1]), points[-1]
    return {"peak": peak[0], "peak_output_tok_s": peak[1], "last": last[0], "last_output_tok_s": last[1],
            "last_relative_to_peak": round(last[1] / peak[1], 3), "total_failed": sum(p[2] for p in points)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="closed-loop concurrency sweep (see above)")
    parser.add_argument("--tiny", action="store_true", help="serve the tests' tiny random Llama")
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--rates", default="0.5,2")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("bench_options", nargs=argparse.REMAINDER, help="-- then options of the bench command")
    args = parser.parse_args()
    extra = [o for o in args.bench_options if o != "--"]
    with tempfile.TemporaryDirectory() as folder:
        model = ["--model", tiny_checkpoint(folder)] if args.tiny else []
        vocab = ["--token-ids", "1", "256"] if args.tiny else ["--token-ids", "100", "40000"]
        grid = concurrency_axis(args.max_concurrency) if args.sweep else f"request_rate={args.rates}"
        count = [] if args.sweep else ["--num-prompts", str(args.requests)]
        result = bench(["sweep", *extra, "--grid", grid, "serve", "--launch", *model, *vocab, *count, *LOAD])
    if args.sweep:
        print(json.dumps(summary(result)), flush=True)


if __name__ == "__main__":
    main()
