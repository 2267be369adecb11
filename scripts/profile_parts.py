"""Where one step of the default engine goes, part by part, at three shapes: batch-1 decode at a
128-token context, batch-64 decode at 128-token contexts, and one 512-token prompt's prefill.

    python scripts/profile_parts.py [--steps 32] [--json PATH] [--quantization none]

It runs ``LLM()`` as a user does (the defaults, every bucket compiled), traces the steps of each
shape with JAX's profiler, and splits each step's wall time into the host's part (the Python step
outside the executable: scheduling, inputs, the launch, the outputs) and the executable's thunks,
each attributed by its HLO instruction in the bucket's compiled program: the quantized and float
matmul kernels (split into the 30 layers' projections and MLP, and the LM head), attention (the
decode attention kernel; a prefill's attention is XLA fusions, counted in the rest), the sampler
(what runs after the LM head), and the rest (norms, rope, residuals, the KV write, XLA's loop and
what passes between thunks). Figures are per step, in milliseconds. The profiler's own cost per
thunk inflates the executable's parts: compare the wall time with the same step untraced.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile

import jax

SHAPES = {"decode, batch 1, context 128": (1, 128, 32), "decode, batch 64, contexts 128": (64, 128, 32),
          "prefill, one prompt of 512": (1, 512, 1)}
PARTS = ("projections + MLP", "LM head", "attention", "sampler", "rest of the executable", "host")


class Recording(dict):
    """The runner's bucket -> executable map, noting which buckets steps look up."""
    used: collections.Counter

    def get(self, key, default=None):
        self.used[key] += 1
        return super().get(key, default)


def targets_by_op(text: str) -> tuple[dict[str, str], list[str]]:
    """HLO instruction name -> custom-call target, and the instructions in program order."""
    targets, order = {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?custom_call_target=\"([^\"]+)\"", line)
        if m:
            targets[m.group(1)] = m.group(2)
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            order.append(m.group(1))
    return targets, order


def part_of(op: str, targets: dict[str, str], head_op: str | None, after_head: set[str]) -> str:
    target = targets.get(op, "")
    if op == head_op:
        return "LM head"
    if "matmul" in target or "sgemm" in target or op.startswith(("dot", "convolution")):
        return "projections + MLP"
    if "attention" in target or "decode" in target or "kv" in target or "attention" in op:
        return "attention"
    if op in after_head:
        return "sampler"
    return "rest of the executable"


def leaves(events: list[dict]) -> list[dict]:
    """The events of one thread that contain no other event (the thunks themselves)."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    out = []
    for i, e in enumerate(events):
        nxt = events[i + 1] if i + 1 < len(events) else None
        if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:
            out.append(e)
    return out


def profile(llm, batch: int, prompt_len: int, steps: int) -> dict:
    from jaxengine import SamplingParams

    runner = llm.runner
    def prompts(seed: int) -> list[dict]:      # new token ids each call: no prefix-cache hit
        return [{"prompt_token_ids": [(7 * i + 13 * j + 1009 * seed) % 20000 + 100 for j in range(prompt_len)]}
                for i in range(batch)]

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    profile.calls = getattr(profile, "calls", 0) + 2
    llm.generate(prompts(profile.calls), params, use_tqdm=False)      # warm-up
    runner._executables = recording = Recording(runner._executables)
    recording.used = collections.Counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        llm.generate(prompts(profile.calls + 1), params, use_tqdm=False)
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz")[0]))
    runner._executables = dict(recording)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    events = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    # the shape's bucket: decode steps are the most looked-up bucket; a prefill is the first step
    bucket = recording.used.most_common(1)[0][0] if prompt_len < 512 else next(iter(recording.used))
    text = recording[bucket].as_text()
    targets, order = targets_by_op(text)
    matmuls = [op for op in order if "matmul" in targets.get(op, "")]
    head_op = matmuls[-1] if matmuls else None               # the last matmul of the program: the LM head
    after_head = set(order[order.index(head_op) + 1:]) if head_op else set()
    runs = collections.defaultdict(lambda: collections.Counter())    # run_id -> part -> us
    walls = {}
    by_thread = collections.defaultdict(list)
    order = {}                                                         # run id -> its place, first seen first
    for e in events:
        args = e.get("args", {})
        if args.get("hlo_module") == "jit_forward" and "run_id" in args:
            by_thread[e["pid"], e["tid"]].append(e)
            order.setdefault(args["run_id"], len(order))
        if e["name"] == "ThunkExecutor::Execute (wait for completion)":
            walls.setdefault(args.get("run_id"), e["dur"])
    for thread, evs in by_thread.items():
        for e in leaves(evs):
            if e["name"].startswith("ThunkExecutor"):
                continue
            runs[e["args"]["run_id"]][part_of(e["args"].get("hlo_op", e["name"]), targets, head_op, after_head)] += e["dur"]
    steps_wall = [e["dur"] for e in events if re.search(r"engine\.py:\d+ step$", e["name"])]
    # the shape's steps: a decode's last steps (its prompts' prefill steps come first), a prefill's first
    count = max(1, steps - 2)
    keep = list(order)[-count:] if prompt_len < 512 else list(order)[:1]
    result = {part: statistics.median(runs[r][part] for r in keep) / 1e3 for part in PARTS[:-1]}
    wall = statistics.median(steps_wall[-count:] if prompt_len < 512 else steps_wall[:1]) / 1e3
    exe = statistics.median(walls.get(r, 0.0) for r in keep) / 1e3
    thunks = sum(result.values())
    result["rest of the executable"] += max(0.0, exe - thunks)      # between thunks: XLA's own dispatch
    result["host"] = max(0.0, wall - exe)
    result["wall"] = wall
    result["bucket"] = list(bucket)
    result["threads"] = sorted({threads.get(t, "?").split("/")[0] for t in by_thread})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quantization", default=None, help="passed to LLM (none: the float32 weights)")
    args = parser.parse_args()
    from jaxengine import LLM

    llm = LLM(progress=False, **({} if args.quantization is None else {"quantization": args.quantization}))
    llm.wait_until_compiled()
    results = {}
    for name, (batch, prompt_len, steps) in SHAPES.items():
        results[name] = profile(llm, batch, prompt_len, args.steps if steps > 1 else 1)
    print("| step | wall ms | " + " | ".join(PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    for name, r in results.items():
        print(f"| {name} | {r['wall']:.2f} | " + " | ".join(f"{r[p]:.2f}" for p in PARTS) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
