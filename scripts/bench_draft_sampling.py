"""Greedy against sampled drafts for requests that sample: the default model (SmolLM2-135M)
drafting for itself, on the CPU, the share of draft tokens kept and the tokens each step outputs.

    python scripts/bench_draft_sampling.py [--temperatures 0.7,1.0] [--k 4] [--tokens 64] [--json PATH]

The model drafting for itself is the case where the draft's distribution is the model's: sampled
drafts (``draft_sampling: "sampled"``) are then kept with probability min(1, p/q) = 1, while a
greedy draft is kept only when the model's own sample repeats its most likely token. A smaller
draft lands between the two. Every draft goes (the gate's choice is overridden: the point is
acceptance); chat prompts from the bench tool's datasets, one request at a time, seeded.
"""
from __future__ import annotations

import argparse
import json

from jaxengine import LLM, SamplingParams
from jaxengine.default_model import default_model_path

PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a haiku about autumn leaves.",
           "List three uses of a paperclip."]
OPTIONS = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, compile_mode="eager")


def run(llm: LLM, temperature: float, tokens: int) -> dict:
    llm.engine.traces = []
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=tokens, ignore_eos=True)
    for prompt in PROMPTS:
        llm.generate([prompt], params, use_tqdm=False)
    traces = llm.engine.traces
    drafted = sum(t.num_draft_tokens for t in traces)
    accepted = sum(t.num_accepted_tokens for t in traces)
    steps = sum(1 for t in traces if t.num_drafts)
    return {"draft_tokens": drafted, "accepted": accepted, "acceptance": round(accepted / max(drafted, 1), 3),
            "tokens_per_drafting_step": round((accepted + steps) / max(steps, 1), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    path = str(default_model_path())
    rows = []
    for mode in ("greedy", "sampled"):
        llm = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": args.k,
                                            "draft_sampling": mode}, **OPTIONS)
        gate = llm.engine.scheduler.gate
        gate.plan = lambda tokens, rows, proposals, limit=None, gate=gate: [min(n, gate.k) for n, _ in proposals]
        for t in (float(x) for x in args.temperatures.split(",")):
            row = {"draft_sampling": mode, "temperature": t, "k": args.k, **run(llm, t, args.tokens)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
