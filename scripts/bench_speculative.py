"""Speculative decoding (n-gram prompt lookup) on the default model against speculation off:
output tokens per second and time per output token, greedy, on a workload whose answers quote
their prompts (correct, repeat, extract, rename) and on one whose answers do not (explain,
write), at batch 1 and over larger batches. Every configuration must give the same tokens as
speculation off (checked). "off, async" is speculation off with async scheduling (each step
launched before the previous one's tokens are known), which a speculating engine does not do
(its drafts start from the tokens just accepted).

    python scripts/bench_speculative.py [--ks 2,4,6] [--batches 1,16,64] [--json PATH]

One engine serves every configuration (``--speculative-config`` with the largest k): its compiled
buckets are the same for all, and k, or speculation itself, is switched between runs by giving
the runner the proposer of that k (or taking the scheduler's speculation gate away). The runs of
one measurement go in turns.
"""
from __future__ import annotations

import argparse
import json
import time

from jaxengine import LLM, SamplingParams
from jaxengine.engine import Engine
from jaxengine.spec_decode.ngram import NgramProposer

TEXT = ("The river Aldwater rises in the northern hills and runs south for ninety miles. Its upper valley "
        "is narrow and wooded; below the town of Marrow it widens into farmland. Three bridges cross it at "
        "Marrow, and a ferry still runs at Coldharbour. The river floods most winters, and the meadows "
        "along its banks are kept for grazing rather than for houses.")
TYPOS = ("Teh river Aldwater rises in the nothern hills and runs suoth for ninety miles. Its uper valley is "
         "narow and wooded; below the town of Marrow it widens into farmlnad. Three bridges cross it at "
         "Marow, and a ferry stil runs at Coldharbour.")
CODE = ("def total(values):\n    x = 0\n    for v in values:\n        if v > 0:\n            x = x + v\n"
        "    return x\n\n\ndef mean(values):\n    x = total(values)\n    return x / len(values)\n")
QUOTING = [
    f"Correct the spelling mistakes in this text and write out the whole corrected text:\n\n{TYPOS}",
    f"Repeat the following paragraph exactly, word for word:\n\n{TEXT}",
    f"Copy out, word for word, every sentence of this text that mentions Marrow:\n\n{TEXT}",
    f"Rewrite this Python code with the variable x renamed to count. Output only the code.\n\n{CODE}",
]
FREE = [
    "Write a short poem about the first frost of autumn.",
    "Explain in a few sentences why the sky is blue.",
    "Give three tips for someone learning to cook.",
    "Describe a busy train station in the morning.",
]


ASYNC_OFF = "off, async"        # speculation off, steps launched ahead (async scheduling)


def run(llm: LLM, prompts: list[str], proposer, gate, max_tokens: int, run_ahead: bool = False
        ) -> tuple[float, list[list[int]], dict]:
    """Seconds, output tokens and speculation counts of one generate() call with ``proposer``
    (None: speculation off; ``gate``: the engine's speculation gate; ``run_ahead``: with async
    scheduling)."""
    engine = llm.engine
    engine.runner.ngram = proposer
    engine.scheduler.gate = None if proposer is None else gate
    engine.async_scheduling = run_ahead
    counts = {"draft": 0, "accepted": 0, "steps": 0}
    record = Engine._record

    def counting(self, launched, output, finished):
        record(self, launched, output, finished)
        counts["draft"] += self.last_trace.num_draft_tokens
        counts["accepted"] += self.last_trace.num_accepted_tokens
        counts["steps"] += 1

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    Engine._record = counting
    try:
        start = time.perf_counter()
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        Engine._record = record
    return seconds, [o.outputs[0].token_ids for o in outputs], counts


def measure(llm: LLM, prompts: list[str], ks: list[int], batch: int, repeats: int, max_tokens: int) -> dict:
    """Each configuration ``repeats`` times in turns; the best time of each."""
    cfg, gate = llm.config.speculative, llm.engine.scheduler.gate
    proposers = {"off": None, ASYNC_OFF: None,
                 **{f"k={k}": NgramProposer(k, cfg.prompt_lookup_max, cfg.prompt_lookup_min) for k in ks}}
    batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch] if batch > 1 else prompts
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    counts: dict[str, dict] = {}
    for name, proposer in proposers.items():    # untimed: each configuration's first run pays first-use costs
        run(llm, batch_prompts[:1], proposer, gate, 8, name == ASYNC_OFF)
    for _ in range(repeats):
        for name, proposer in proposers.items():
            if batch == 1:                           # one request at a time
                results = [run(llm, [p], proposer, gate, max_tokens, name == ASYNC_OFF) for p in batch_prompts]
                seconds = sum(r[0] for r in results)
                out = [t for r in results for t in r[1]]
                c = {key: sum(r[2][key] for r in results) for key in ("draft", "accepted", "steps")}
            else:
                seconds, out, c = run(llm, batch_prompts, proposer, gate, max_tokens, name == ASYNC_OFF)
            best[name] = min(best.get(name, float("inf")), seconds)
            tokens[name], counts[name] = out, c
    num_tokens = sum(map(len, tokens["off"]))
    rows = {}
    for name in proposers:
        rows[name] = {"seconds": round(best[name], 3), "tokens_per_s": round(num_tokens / best[name], 1),
                      "tpot_ms": round(1e3 * best[name] * batch / num_tokens, 2) if batch > 1 else
                      round(1e3 * best[name] / num_tokens, 2),
                      "speedup": round(best["off"] / best[name], 2), "same_tokens": tokens[name] == tokens["off"],
                      "draft_tokens": counts[name]["draft"], "accepted_tokens": counts[name]["accepted"],
                      "steps": counts[name]["steps"]}
        if counts[name]["draft"]:
            rows[name]["acceptance"] = round(counts[name]["accepted"] / counts[name]["draft"], 3)
    return {"batch": batch, "output_tokens": num_tokens, "configs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)}, compile_mode="eager")
    results = {"ks": ks, "workloads": {}}
    for workload, prompts in (("quoting", QUOTING), ("free", FREE)):
        rows = []
        for batch in [int(b) for b in args.batches.split(",")]:
            row = measure(llm, prompts, ks if batch == 1 else [max(ks) // 2 or 1], batch, args.repeats,
                          args.max_tokens)
            print(workload, json.dumps(row), flush=True)
            rows.append(row)
        results["workloads"][workload] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
