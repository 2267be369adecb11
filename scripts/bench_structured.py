"""What structured output costs: the engine's decode step with half of its rows under a grammar
against none, same engine, same workload, in alternating turns; and the host time per
constrained token (filling its row of the token bitmask, advancing its matcher).

Workload: the default model (or ``--tiny``), ``--batch`` requests of ``--prompt`` random token ids,
each decoding ``--output`` tokens greedily with ``ignore_eos``. In the constrained turns every
other request follows the regex ``[a-z ]+`` (lowercase words: its mask allows the vocabulary's
lowercase-and-space tokens, and EOS once a word is written). A step's time is the wall time of
``Engine.step``; a turn gives the median of its full-batch decode steps (a row that ends early,
by EOS, shrinks the batch: those steps are left out). Reported: the medians over turns, the
median of the per-turn ratios (constrained / none), and the grammar's host time per
constrained token: filling its row of the mask, and advancing its matcher, per call.

    python scripts/bench_structured.py [--batch 64] [--repeats 5] [--out structured.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from jaxengine import LLM, SamplingParams
from jaxengine.bench.report import write_result
from jaxengine.sampling_params import StructuredOutputsParams
from jaxengine.core.structured_output import Matcher


class Timer:
    """Wraps a method of a class and sums the time spent in it."""

    def __init__(self, cls, name: str) -> None:
        self.total, self.calls = 0.0, 0
        original = getattr(cls, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start
                self.calls += 1

        setattr(cls, name, timed)


def turn(llm: LLM, args, constrained: bool, rng: random.Random) -> dict:
    engine = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    regex = StructuredOutputsParams(regex="[a-z ]+")
    grammar = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True, structured_outputs=regex)
    vocab = llm.model_config.vocab_size
    for i in range(args.batch):
        params = grammar if constrained and i % 2 else plain
        engine.add_request(f"{constrained}-{time.monotonic_ns()}-{i}", [rng.randrange(100, vocab - 100)
                                                                         for _ in range(args.prompt)], params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        out = engine.last_output
        if out.num_prefill_tokens == 0 and len(out.seq_ids) == args.batch:
            times.append(time.perf_counter() - start)
    engine.flush()
    return {"constrained": constrained, "decode_step_ms": statistics.median(times) * 1e3, "steps": len(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead of the default model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--output", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5, help="pairs of turns")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = None
        if args.tiny:
            from tiny_checkpoint import tiny_checkpoint

            model = tiny_checkpoint(folder)
        llm = LLM(model, max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch * args.prompt),
                  max_model_len=args.prompt + args.output + 16, progress=False)
        llm.wait_until_compiled()
        fill, advance = Timer(Matcher, "fill"), Timer(Matcher, "accept")
        rng = random.Random(0)
        turn(llm, args, True, rng)                             # warm-up: compiles, the grammar's first masks
        fill.total = advance.total = 0.0
        fill.calls = advance.calls = 0
        rows = []
        for r in range(args.repeats):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                rows.append(turn(llm, args, constrained, rng))
                print(json.dumps(rows[-1]), flush=True)
    ratios = [b["decode_step_ms"] / a["decode_step_ms"] if b["constrained"] else a["decode_step_ms"] / b["decode_step_ms"]
              for a, b in zip(rows[::2], rows[1::2])]
    summary = {
        "batch": args.batch, "model": "tiny" if args.tiny else "default",
        "decode_step_ms_none": statistics.median(r["decode_step_ms"] for r in rows if not r["constrained"]),
        "decode_step_ms_half": statistics.median(r["decode_step_ms"] for r in rows if r["constrained"]),
        "median_paired_ratio": statistics.median(ratios), "paired_ratios": [round(x, 4) for x in ratios],
        "mask_fill_us_per_constrained_token": fill.total / fill.calls * 1e6, "mask_fills": fill.calls,
        "advance_us_per_constrained_token": advance.total / advance.calls * 1e6, "advances": advance.calls,
    }
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        write_result({"summary": summary, "turns": rows}, Path(args.out))


if __name__ == "__main__":
    main()
