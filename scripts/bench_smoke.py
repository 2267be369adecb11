"""Speed smoke of the default model: batch-1 and batch-64 decode tokens/s, each from a fresh
process running the engine as a user's would (XLA's own flags, none of the test suite's), checked
against the figures BENCHMARKS.md records for this kind of machine. Run it before a change to
``runner/``, ``models/`` or ``kernels/`` lands: it fails loudly (exit status 1) below half of them.

    python scripts/bench_smoke.py                       # this checkout, checked against BENCHMARKS.md
    python scripts/bench_smoke.py --baseline-tree DIR   # and another checkout (a git worktree of another
                                                        # commit), measured in the same run, for a ratio

Decode speed is the difference of two runs of the same shape that differ only in output length
(16 and 16 + ``--tokens`` greedy tokens, distinct random prompts of 128 tokens, ``ignore_eos``): the
prompts' prefill, the first step and the engine's start cancel out. Each batch size runs in its own
process with its step buckets compiled before the clock starts (``compile_mode="eager"``, only the
buckets the run needs), so neither compilation nor the other run's heap is in the figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Speed smoke"
BATCHES = (1, 64)
PROMPT_LEN, FIRST = 128, 16
TEST_ONLY_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters", "--xla_backend_optimization_level")


def machine_kind() -> str:
    """What the figures depend on: the CPU's vendor and model name and its widest vector units."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name, flags = (re.search(rf"^{key}\s*:\s*(.+)$", info, re.M) for key in ("model name", "flags"))
    flags = set(flags.group(1).split()) if flags else set()
    isa = " + ".join(name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
                     if flag in flags)
    isa = isa.split(" + ", 1)[-1] if isa.count(" + ") else isa or platform.machine()      # the widest, + AMX
    cpu = re.sub(r"\s+", " ", name.group(1)).strip() if name else platform.processor() or platform.machine()
    cpu = re.sub(r"\s*\d+-Core Processor|\(R\)|\(TM\)|\s+Processor$", "", cpu).strip()
    return f"{cpu}, {isa}, {os.cpu_count()} cores"


def measure(batch: int, tokens: int) -> dict:
    """In this process: decode tokens/s at ``batch`` sequences."""
    import numpy as np

    from jaxengine import LLM, SamplingParams

    budget = 64 if batch == 1 else 8 * batch                 # prefill chunks; a decode step is `batch` tokens
    llm = LLM(max_num_seqs=batch, max_num_batched_tokens=budget, token_buckets=sorted({batch, budget}),
              request_buckets=[batch], max_model_len=PROMPT_LEN + FIRST + tokens + 16, compile_mode="eager",
              progress=False)
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size

    def run(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.integers(100, vocab, PROMPT_LEN).tolist()} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return time.perf_counter() - start

    run(2)                                                   # the first steps of each bucket
    short, long = run(FIRST), run(FIRST + tokens)
    return {"batch": batch, "tokens": tokens, "seconds": long - short,
            "tok_per_s": batch * tokens / (long - short)}


def engine_env(tree: Path) -> dict:
    """The environment of a user's process: the tree on the path, and none of the test suite's XLA
    flags (which compile faster and run another program)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] not in TEST_ONLY_XLA_FLAGS]
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("JAXENGINE_TEST_FAST_COMPILE", None)
    return env


def measure_tree(tree: Path, batch: int, tokens: int) -> dict:
    """A fresh process for one figure (its result on the last line of its output)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(batch), "--tokens", str(tokens)]
    done = subprocess.run(cmd, env=engine_env(tree), cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_smoke: the run at batch {batch} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def recorded(kind: str, benchmarks: Path = ROOT / "BENCHMARKS.md") -> dict[int, float] | None:
    """This machine kind's row of the speed-smoke table in BENCHMARKS.md: {batch: tok/s}."""
    text = benchmarks.read_text()
    section = text.split(SECTION, 1)[1] if SECTION in text else ""
    for line in section.split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] == kind:
            return {batch: float(re.sub(r"[^\d.]", "", cell)) for batch, cell in zip(BATCHES, cells[1:3])}
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-tree", type=Path, help="another checkout to measure in the same run")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens timed per sequence (default 64)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(measure(args.worker, args.tokens)), flush=True)
        return 0
    kind = machine_kind()
    trees = [("this checkout", ROOT)] + ([("baseline", args.baseline_tree.resolve())] if args.baseline_tree else [])
    figures = {label: {b: measure_tree(tree, b, args.tokens)["tok_per_s"] for b in BATCHES} for label, tree in trees}
    print(f"machine: {kind}")
    print("| tree | " + " | ".join(f"batch-{b} decode tok/s" for b in BATCHES) + " |")
    for label, tree in trees:
        print(f"| {label} ({tree}) | " + " | ".join(f"{figures[label][b]:.1f}" for b in BATCHES) + " |")
    want = recorded(kind)
    if want is None:
        print(f"bench_smoke: FAILED: BENCHMARKS.md records no figures for this machine ({kind!r}); add its row to "
              f"the table under '{SECTION}':\n| {kind} | " + " | ".join(
                  f"{figures['this checkout'][b]:.1f}" for b in BATCHES) + " | (date) |", file=sys.stderr)
        return 2
    slow = [b for b in BATCHES if figures["this checkout"][b] < want[b] / 2]
    for b in BATCHES:
        print(f"batch {b}: {figures['this checkout'][b]:.1f} tok/s, recorded {want[b]:.1f} "
              f"({figures['this checkout'][b] / want[b]:.2f}x)")
    if slow:
        print(f"bench_smoke: FAILED: below half the recorded decode speed at batch {', '.join(map(str, slow))} "
              f"on {kind}", file=sys.stderr)
        return 1
    print("bench_smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
