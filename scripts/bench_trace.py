"""What a trace file costs: the engine's step with ``trace_file`` on against off, same engine,
same workload, in turns.

Workload: a tiny random-weight Llama through ``LLM`` on this machine's first device, ``--batch``
requests of ``--prompt`` tokens each generating ``--output`` tokens greedily: one prefill step,
then decode steps of ``--batch`` rows. A step's time is the wall time of ``Engine.step``; each
turn gives the median of its full-batch decode steps; reported are the medians over turns and
the median of each turn's on/off ratio (the two modes run back to back, so load on a shared
machine that drifts between turns cancels). Tracing is toggled on the one engine
(its ``TraceWriter`` set or not), so both modes run the same compiled steps. Measured directly
too, as wall-time differences of a few tenths of a percent drown in a shared machine's noise:
the time the engine spent in the writer during the traced turns, per step, and the pure cost of
one record (``TraceWriter.write`` in a loop, its batched file writes included), in µs.

    python scripts/bench_trace.py [--repeats 30] [--batch 64] [--out trace_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxengine import LLM, SamplingParams
from jaxengine.bench.report import write_result
from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.trace import StepTrace, TraceWriter

TINY = ModelConfig("LlamaForCausalLM", vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=64)


def build_llm(batch: int, prompt: int, output: int, trace_file: Path) -> LLM:
    model = LlamaForCausalLM(TINY, rngs=nnx.Rngs(0))
    budget = batch * prompt
    return LLM(model, model_config=TINY, progress=False, max_num_seqs=batch, max_num_batched_tokens=budget,
               token_buckets=[batch, budget], request_buckets=[batch], block_size=16,
               max_model_len=prompt + output + 16, enable_prefix_caching=False,
               num_kv_blocks=batch * ((prompt + output) // 16 + 2) + 1, trace_file=str(trace_file),
               compile_mode="eager")


def decode_step_times(llm: LLM, batch: int, prompt: int, output: int, seed: int) -> list[float]:
    """Wall time of each full-batch decode step of one pass."""
    engine, rng = llm.engine, np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", rng.integers(0, TINY.vocab_size, prompt).tolist(), params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if engine.last_trace.num_decode_tokens == batch:
            times.append(wall)
    engine.flush()
    return times


class TimedWriter:
    """A ``TraceWriter`` that times each call into it: wall time, and the calling thread's CPU
    time (which a loaded machine's preemptions do not inflate)."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self.calls: dict[str, list[float]] = {"write": [], "flush": [], "close": []}
        self.cpu_s = 0.0

    def write(self, trace: StepTrace) -> None:
        self._timed("write", trace)

    def flush(self) -> None:
        self._timed("flush")

    def close(self) -> None:
        self._timed("close")

    def _timed(self, name: str, *args) -> None:
        start, cpu_start = time.perf_counter(), time.thread_time()
        getattr(self.writer, name)(*args)
        self.cpu_s += time.thread_time() - cpu_start
        self.calls[name].append(time.perf_counter() - start)


def record_cost_us(n: int = 100_000) -> float:
    """µs per ``TraceWriter.write`` of a typical record, the file writes it batches included."""
    with tempfile.TemporaryDirectory() as folder:
        writer = TraceWriter(Path(folder) / "steps.jsonl")
        record = _typical_record()
        start = time.perf_counter()
        for _ in range(n):
            writer.write(record)
        writer.close()
        return (time.perf_counter() - start) / n * 1e6


def _typical_record() -> StepTrace:
    return StepTrace(step=12345, time=123.456789, num_rows=64, num_decode_tokens=64, num_prefill_tokens=0,
                     num_preemptions=0, num_blocks_swapped_in=0, num_blocks_swapped_out=0, num_swap_fallbacks=0,
                     kv_usage=0.4213197969543147, num_prefix_hit_tokens=0, num_waiting=3, num_running=64,
                     num_swapped=0, step_s=0.004321, host_s=0.001234, device_idle_s=0.000456)


def compare(repeats: int, batch: int, prompt: int, output: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        trace_file = Path(folder) / "steps.jsonl"
        llm = build_llm(batch, prompt, output, trace_file)
        engine, writer = llm.engine, llm.engine.trace_writer
        timed = TimedWriter(writer)
        turns, num_traced_steps = {"off": [], "on": []}, 0
        for rep in range(repeats + 1):                  # the first pass warms up
            order = ("off", "on") if rep % 2 else ("on", "off")
            for mode in order:
                engine.trace_writer = timed if mode == "on" else None
                steps_before = engine.num_steps
                median = statistics.median(decode_step_times(llm, batch, prompt, output, seed=rep))
                if rep:
                    turns[mode].append(median)
                if mode == "on":
                    num_traced_steps += engine.num_steps - steps_before
        engine.trace_writer = timed
        engine.close()
        num_records = writer.num_records
    off, on = statistics.median(turns["off"]), statistics.median(turns["on"])
    # Each turn runs both modes back to back: their ratio cancels the load that drifts between turns.
    paired = statistics.median(t_on / t_off for t_on, t_off in zip(turns["on"], turns["off"]))
    per_record = record_cost_us()
    return {"device": str(jax.devices()[0]), "jax": jax.__version__, "batch": batch, "prompt": prompt,
            "output": output, "repeats": repeats, "records_written": num_records,
            "decode_step_ms_off": round(off * 1e3, 3), "decode_step_ms_on": round(on * 1e3, 3),
            "on_vs_off": round(on / off, 4), "on_vs_off_paired": round(paired, 4),
            "turn_medians_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in turns.items()},
            "in_engine_cpu_us_per_step": round(timed.cpu_s / num_traced_steps * 1e6, 2),
            "in_engine_cpu_vs_step": round(timed.cpu_s / num_traced_steps / off, 5),
            "in_engine_write_wall_us": {"median": round(statistics.median(timed.calls["write"]) * 1e6, 2),
                                        "p99": round(float(np.quantile(timed.calls["write"], 0.99)) * 1e6, 2)},
            "in_engine_flushes": len(timed.calls["flush"]),
            "record_us": round(per_record, 2), "record_vs_step": round(per_record * 1e-6 / off, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    result = compare(args.repeats, args.batch, args.prompt, args.output)
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
