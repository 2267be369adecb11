"""Measuring an engine: its step times over a grid of step shapes, and the profile fitted to them.

For each (context length, decode rows) of the grid the engine runs the real model: it prefills
``rows`` prompts of ``context`` tokens (sharing a prefix, so that the prefix cache keeps this
short), then, with those rows decoding, adds one prompt that fills each token bucket (to its top
and to just past the bucket below) for one step, then runs a few plain decode steps. Every step
is a measured point (its shape from the step trace, its time the trace's ``step_s``); the
profile is fitted on them all.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from jaxengine.costmodel.profile import CostProfile, machine_description, trace_points
from jaxengine.engine import Engine
from jaxengine.sampling_params import SamplingParams

UNIQUE_TAIL = 16            # prompt tokens of each decode row of a scenario that are its own


@dataclass(frozen=True)
class CalibrationGrid:
    """The step shapes measured: every (context, rows) pair that fits the engine's limits."""

    contexts: tuple[int, ...] = (32, 256, 1024)
    rows: tuple[int, ...] = (1, 4, 16, 48)
    decode_steps: int = 4
    repeats: int = 1


SPEED_CHECK_GRID = CalibrationGrid(contexts=(256,), rows=(1, 4, 16), decode_steps=8)


def calibrate_engine(engine: Engine, grid: CalibrationGrid, *, progress: bool = True, seed: int = 0,
                     model_config=None) -> CostProfile:
    """Measure ``engine``'s steps over ``grid`` (the engine must be idle) and fit a profile; with
    the ``model_config``, the profile holds its parameter counts, and a mixture of experts' steps
    are fitted by their routed tokens too."""
    shapes, step_buckets, seconds = measure_engine(engine, grid, progress=progress, seed=seed)
    cc, sc = engine.config.cache, engine.config.scheduler
    source = {**machine_description(), "num_steps": len(seconds), "grid": asdict(grid)}
    model = {} if model_config is None else dict(
        routed_pairs_per_token=model_config.routed_pairs_per_token, num_params=model_config.num_params,
        num_active_params=model_config.num_active_params)
    return CostProfile.fit(shapes, step_buckets, seconds, num_gpu_blocks=cc.num_gpu_blocks, block_size=cc.block_size,
                           num_cpu_blocks=cc.num_cpu_blocks, max_model_len=sc.max_model_len, source=source,
                           group_windows=cc.group_windows, **model)


def measure_engine(engine: Engine, grid: CalibrationGrid, *, progress: bool = True, seed: int = 0):
    """Run ``grid``'s scenarios on ``engine`` (idle) -> (shapes, token buckets, seconds) of its steps."""
    if engine.has_unfinished_requests():
        raise ValueError("calibrate: the engine has unfinished requests")
    runner = engine.runner
    buckets = list(runner.token_buckets)
    vocab = getattr(getattr(runner, "batch", None), "vocab_size", None) or 1000
    rng = random.Random(seed)
    engine.traces = []
    scenarios = [(c, r) for c, r in itertools.product(grid.contexts, grid.rows) if _fits(engine, c, r, grid)]
    if not scenarios:
        raise ValueError("calibrate: no (context, rows) of the grid fits this engine's limits")
    for _ in range(grid.repeats):
        for context, rows in tqdm(scenarios, desc="calibrating", disable=not progress):
            _scenario(engine, context, rows, buckets, grid.decode_steps, vocab, rng)
    return trace_points(engine.traces, buckets, list(runner.request_buckets))


def _fits(engine: Engine, context: int, rows: int, grid: CalibrationGrid) -> bool:
    sc, cc = engine.config.scheduler, engine.config.cache
    length = context + grid.decode_steps + 2 * len(engine.runner.token_buckets) + 2
    blocks = rows * -(-length // cc.block_size) + -(-sc.max_num_batched_tokens // cc.block_size)
    return (rows < sc.max_num_seqs and rows < sc.max_num_batched_tokens and length <= sc.max_model_len
            and blocks <= cc.num_gpu_blocks - 1 - int(cc.watermark * cc.num_gpu_blocks))


def _scenario(engine: Engine, context: int, rows: int, buckets: list[int], decode_steps: int, vocab: int,
              rng: random.Random) -> None:
    """Prefill ``rows`` prompts of ``context`` tokens, then one step per prefill size beside
    their decodes, then plain decodes; everything is aborted at the end."""
    max_len = engine.config.scheduler.max_model_len
    params = SamplingParams(max_tokens=max_len - context, ignore_eos=True, temperature=0.0)
    ids = [f"calibrate-{rng.random()}" for _ in range(rows)]
    # The rows share all but their last block's worth of prompt: with prefix caching only the first
    # prefills the whole context, yet every row attends to all of it when it decodes.
    shared = _prompt(rng, max(context - UNIQUE_TAIL, 0), vocab)
    for rid in ids:
        engine.add_request(rid, shared + _prompt(rng, context - len(shared), vocab), params)
    while any(len(s.token_ids) - s.num_computed_tokens > 1 for r in engine.scheduler.running for s in r.seqs) \
            or len(engine.scheduler.waiting):
        engine.step()
    for size in _prefill_sizes(buckets, rows):
        rid = f"calibrate-prefill-{rng.random()}"
        engine.add_request(rid, _prompt(rng, size, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()
        engine.abort(rid)
    for _ in range(decode_steps):
        engine.step()
    for rid in ids:
        engine.abort(rid)
    engine.step()                          # an empty step: the runner forgets the aborted rows


def _prefill_sizes(buckets: list[int], rows: int) -> list[int]:
    """Prompt sizes that, beside ``rows`` decodes, fill each bucket to its top and to just past
    the bucket below (a step pays for its padded bucket, its host work for its real tokens)."""
    sizes = []
    for lo, hi in zip([0, *buckets], buckets):
        for total in (hi, lo + 1):
            if total - rows >= 1 and total - rows not in sizes:
                sizes.append(total - rows)
    return sizes


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]
