"""Step latency: the compiled step's time per (token bucket, row bucket) pair.

Each pair the engine compiled and can run is timed with realistic fill:
- prefill: ``rows`` fresh prompts sharing exactly ``tokens`` tokens (the whole bucket), no cached
  context: one step of the engine schedules them all;
- decode: ``rows`` sequences of ``--context-len`` tokens each decoding one token (the token bucket
  is the smallest holding ``rows``).

The engine schedules and runs the step as it would in service; its prepared inputs are then
launched again ``--repeats`` times on the compiled step (host-to-device transfer included, as in
every step), and the median is reported; a pair whose step the engine did not run within a
bounded number of steps is reported with ``reached: false``. Prefix caching is off (so a prompt is all computed) and
async scheduling off (one step in flight).

``--baseline matmul`` measures this device's matmul rate in the same run (in the model's dtype)
and states each step against the floor it gives: the projection and MLP FLOPs of the step's
tokens at that rate (``x_matmul_floor``; attention and everything else left out).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass

import jax
from tqdm.auto import tqdm

from jaxengine.bench.report import print_table
from jaxengine.costmodel.floors import floor_seconds, flops_per_token, matmul_gflops
from jaxengine.bench.throughput import model_info, start_engine
from jaxengine.core.scheduler_output import NO_MOVES
from jaxengine.engine_args import EngineArgs, comma_separated
from jaxengine.sampling_params import SamplingParams

KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class StepPlan:
    kind: str
    tokens: int           # tokens the step computes
    rows: int
    context_len: int      # decode: tokens each row holds before the step


def add_arguments(parser) -> None:
    group = parser.add_argument_group("latency")
    group.add_argument("--repeats", type=int, default=5, help="timed launches per bucket pair (median reported)")
    group.add_argument("--context-len", type=int, default=256, help="decode: context tokens of each row")
    group.add_argument("--kinds", type=comma_separated(str), default=list(KINDS), help="prefill, decode or both")
    group.add_argument("--seed", type=int, default=0, help="seed of the prompts' random token ids")
    group.add_argument("--baseline", choices=["matmul"], default=None,
                       help="state each step against the matmul floor measured in the same run")
    EngineArgs.add_cli_args(parser)


def run(args) -> dict:
    if unknown := set(args.kinds) - set(KINDS):
        raise ValueError(f"--kinds: {sorted(unknown)} not among {list(KINDS)}")
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), enable_prefix_caching=False,
                                      async_scheduling=False)
    if engine_args.data_parallel_size > 1 or engine_args.num_processes not in (None, 1):
        raise ValueError("latency: times one engine in one process (data_parallel_size 1, one process)")
    llm, startup_s = start_engine(engine_args, args.progress)
    plans = step_plans(llm, args.kinds, args.context_len)
    rng = random.Random(args.seed)
    rows = [time_step(llm, plan, args.repeats, rng)
            for plan in tqdm(plans, desc="timing buckets", unit="bucket", disable=not args.progress)]
    result = {"mode": "latency", "engine_args": dataclasses.asdict(llm.engine_args), "model": model_info(llm),
              "startup_s": startup_s, "repeats": args.repeats, "rows": rows}
    if args.baseline == "matmul":
        result["baseline"] = matmul_floor(llm, rows)
    print_table([table_row(r) for r in rows], title=f"step latency, median of {args.repeats}")
    return result


def matmul_floor(llm, rows: list[dict]) -> dict:
    """The matmul rate measured now, the floor per token it gives, and each reached row's
    time per token against it (in place)."""
    gflops = matmul_gflops(dtype=llm.dtype)
    floor_us = floor_seconds(flops_per_token(llm.model_config), gflops * 1e9) * 1e6
    for row in rows:
        row["x_matmul_floor"] = row["us_per_token"] / floor_us if row["reached"] else None
    return {"matmul_gflops": gflops, "floor_us_per_token": floor_us}


def step_plans(llm, kinds: list[str], context_len: int) -> list[StepPlan]:
    """Every pair the runner compiled that such a step fills: prefill (t, b) with b <= t, and
    decode b rows for each row bucket b (in the pair ``buckets.step_bucket`` gives b tokens)."""
    runner, limit = llm.runner, llm.config.scheduler.max_model_len
    pairs = runner.bucket_pairs()
    plans = []
    if "prefill" in kinds:
        plans += [StepPlan("prefill", t, b, 0) for t, b in pairs if b <= t and math.ceil(t / b) < limit]
    if "decode" in kinds:
        context = min(context_len, limit - 2)
        plans += [StepPlan("decode", b, b, context) for b in sorted({b for _, b in pairs})
                  if b <= runner.token_buckets[-1]]
    return plans


def time_step(llm, plan: StepPlan, repeats: int, rng: random.Random) -> dict:
    """Run the plan's step in the engine, then time its inputs on the compiled step."""
    inputs, out = run_until_step(llm, plan, rng)
    row = {"kind": plan.kind, "reached": inputs is not None, "token_bucket": None, "row_bucket": None,
           "tokens": 0, "rows": 0, "context_len": plan.context_len, "step_ms": None, "us_per_token": None,
           "times_ms": [], "planned": dataclasses.asdict(plan)}
    if inputs is None:
        return row
    times = [_timed_launch(llm.runner, inputs) for _ in range(repeats)]
    median, tokens = statistics.median(times), out.num_prefill_tokens + out.num_decode_tokens
    row.update(token_bucket=inputs.bucket[0], row_bucket=inputs.bucket[1], tokens=tokens, rows=len(out.seq_ids),
               step_ms=median * 1e3, us_per_token=median / tokens * 1e6, times_ms=[t * 1e3 for t in times])
    return row


def run_until_step(llm, plan: StepPlan, rng: random.Random):
    """Add the plan's requests and step the engine until it runs the planned kind of step (at
    most a bounded number of steps); returns that step's inputs and scheduler output, with every
    request of the plan aborted and forgotten. (None, None) if the step never came: the KV pool
    cannot hold the rows, or (decode) the first rows reach the context length before the last
    ones are prefilled, when the token budget is not much above the rows."""
    engine, limit = llm.engine, llm.config.scheduler.max_model_len
    budget = llm.config.scheduler.max_num_batched_tokens
    # Decodes of the rows already prefilled share the budget with the others' prefill.
    max_steps = math.ceil(plan.rows * (plan.context_len + 1) / max(budget - plan.rows, 1)) + plan.rows + 4
    lengths = _split(plan.tokens, plan.rows) if plan.kind == "prefill" else [plan.context_len] * plan.rows
    max_tokens = 1 if plan.kind == "prefill" else min(max_steps + 2, limit - plan.context_len)
    vocab = llm.model_config.vocab_size
    ids = [engine.add_request(f"latency-{plan.kind}-{plan.tokens}-{plan.rows}-{i}",
                              [rng.randrange(vocab) for _ in range(n)],
                              SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)).request_id
           for i, n in enumerate(lengths)]
    found = None, None
    with recording_launches(llm.runner) as launched:
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            launched.clear()
            engine.step()
            out = engine.last_output
            if launched and _is_planned(plan, out):
                found = launched[-1], out
                break
    for request_id in ids:
        engine.abort(request_id)
    engine.flush()
    return found


def _is_planned(plan: StepPlan, out) -> bool:
    if plan.kind == "prefill":
        return bool(out.seq_ids)          # the first step: every prompt that fits (1-token ones count as decodes)
    return out.num_prefill_tokens == 0 and len(out.seq_ids) == plan.rows


def _split(tokens: int, rows: int) -> list[int]:
    """``tokens`` over ``rows`` prompts as evenly as can be."""
    return [tokens // rows + (i < tokens % rows) for i in range(rows)]


@contextlib.contextmanager
def recording_launches(runner):
    """Within: ``launched`` lists the inputs of each step the runner launches."""
    launched, launch = [], runner.launch

    def recording(moves, inputs):
        if inputs is not None:
            launched[:] = [inputs]          # only the latest is kept
        return launch(moves, inputs)

    runner.launch = recording
    try:
        yield launched
    finally:
        del runner.launch                   # the class's method again


def _timed_launch(runner, inputs) -> float:
    start = time.perf_counter()
    jax.block_until_ready(runner.launch(NO_MOVES, inputs))
    return time.perf_counter() - start


def table_row(row: dict) -> dict:
    return {"kind": row["kind"], "reached": row["reached"], "tokens": row["tokens"], "rows": row["rows"],
            "bucket": f"({row['token_bucket']}, {row['row_bucket']})", "context": row["context_len"],
            "median ms": row["step_ms"], "us/token": row["us_per_token"], "x floor": row.get("x_matmul_floor")}
