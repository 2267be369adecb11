"""Offline throughput: a workload through LLM.generate, optionally against baselines.

The workload's requests run greedy with ``ignore_eos`` (every request generates exactly its
output length) on an engine built from any engine flags.

Reports requests/s, input and output tokens/s over the generation's wall time (start-up, i.e.
loading and compiling, apart), the prefix-cache hit rate (cached prompt tokens / prompt tokens),
preemptions and swapped blocks from the engine's step traces, per-request latencies, and the
host's work per step with the device's idle time (async scheduling's effect). The
result keeps the step traces for plots (``"traces"``: one ``StepTrace`` dict per step, with
``time_s``: when the step ended, from the start of the generation).

``--beam-width K`` runs each request as a beam search of width K instead (``LLM.beam_search``;
output tokens are those of the K hypotheses returned) and reports the KV blocks held at the peak
against what the same beams would hold with every block copied (no sharing, no copy-on-write).

``--baseline hf`` / ``--baseline naive`` (repeatable) run the same requests through transformers
or a plain JAX loop (see ``hf_baseline`` and ``naive_baseline``) in static batches, in the same
invocation; the result holds their figures, the ratios jaxengine / baseline, and whether their
greedy tokens equal the engine's. ``--baseline vllm --vllm-python PATH`` runs them through vLLM's
offline ``LLM`` in its own venv and process, with the engine's limits (``vllm_baseline``).
``--baseline llamacpp --llamacpp-bin DIR`` runs them through llama.cpp's ``llama-server`` (a
subprocess: ``max_num_seqs`` slots of ``max_model_len`` tokens, continuous batching) on the
engine's GGUF or ``--llamacpp-model`` (``llamacpp_baseline``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from jaxengine.bench.datasets import BenchRequest, add_dataset_arguments, describe, load_requests
from jaxengine.bench.report import print_table, summarize
from jaxengine.core.kv_cache_manager import cdiv
from jaxengine.engine_args import EngineArgs
from jaxengine.sampling_params import SamplingParams

BASELINES = ("hf", "naive", "vllm", "llamacpp")


def add_arguments(parser) -> None:
    add_dataset_arguments(parser)
    group = parser.add_argument_group("sampling")
    group.add_argument("--n", type=int, default=1,
                       help="sequences per request (a group sharing the prompt's KV blocks; n > 1 samples)")
    group.add_argument("--temperature", type=float, default=None,
                       help="default: 0 (greedy) for n = 1, else 1 (n greedy copies would be the same sequence)")
    group.add_argument("--beam-width", type=int, default=0, help="run each request as a beam search of this width")
    group = parser.add_argument_group("baselines")
    group.add_argument("--baseline", action="append", choices=BASELINES, default=[],
                       help="also run the workload through transformers (hf) or a plain JAX dense-cache loop "
                            "(naive), in static batches, or through vLLM (vllm) or llama.cpp's server (llamacpp) "
                            "with the engine's limits; repeatable")
    group.add_argument("--baseline-batch-size", type=int, default=16, help="requests per static batch")
    group.add_argument("--vllm-python", default=None,
                       help="--baseline vllm: the python of a venv with vLLM installed (its CPU build here)")
    group.add_argument("--vllm-model", default=None,
                       help="--baseline vllm: a Hugging Face folder of the same model (default: --model)")
    group.add_argument("--vllm-kv-cache-bytes", type=int, default=1 << 30,
                       help="--baseline vllm: its kv_cache_memory_bytes (it otherwise reserves most of the RAM)")
    group.add_argument("--llamacpp-bin", metavar="DIR", default=None,
                       help="--baseline llamacpp: the folder of llama.cpp's built binaries (llama-server in it)")
    group.add_argument("--llamacpp-model", metavar="FILE", default=None,
                       help="--baseline llamacpp: a GGUF file of the same model (default: the engine's model, when "
                            "a GGUF file, as the default model is)")
    group.add_argument("--llamacpp-threads", type=int, metavar="N", default=None,
                       help="--baseline llamacpp: llama-server's -t (default: the CPUs this process may use)")
    EngineArgs.add_cli_args(parser)


def run(args) -> dict:
    if args.n > 1 and args.baseline:
        raise ValueError("--baseline runs one greedy sequence per request: use --n 1")
    if args.beam_width and (args.n > 1 or {"naive", "vllm", "llamacpp"} & set(args.baseline)):
        raise ValueError("--beam-width: with --n 1, against --baseline hf only")
    if "vllm" in args.baseline:
        from jaxengine.bench.vllm_baseline import check_options

        check_options(args.vllm_python, args.vllm_model or args.model)     # before the engine starts
    if "llamacpp" in args.baseline:
        from jaxengine.bench import llamacpp_baseline

        llamacpp_baseline.check_options(args)
    llm, startup_s = start_engine(EngineArgs.from_cli_args(args), args.progress)
    if "naive" in args.baseline:
        from jaxengine.bench.naive_baseline import check_serves

        check_serves(llm.model_config)                      # before the engine's run, not after
    requests = load_requests(args, llm.model_config.vocab_size, llm.encode if llm.tokenizer else None,
                             llm.config.scheduler.max_model_len)
    result = {"mode": "throughput", "engine_args": dataclasses.asdict(llm.engine_args), "model": model_info(llm),
              "workload": describe(args), "sampling": sampling_params(args)}
    if args.beam_width:
        result["sampling"] = {"beam_width": args.beam_width}
        result.update(measure_beams(llm, requests, args.beam_width, args.progress))
    else:
        result.update(measure(llm, requests, sampling_params(args), args.progress))
    result["metrics"]["startup_s"] = startup_s
    tokens = result.pop("tokens")
    result["baselines"] = {name: run_baseline(name, llm, requests, args, result["metrics"], tokens)
                           for name in dict.fromkeys(args.baseline)}
    print_table(table_rows(result), title="offline throughput")
    return result


def model_info(llm) -> dict:
    """Which model ran, its shape, dtype and device, for the result file."""
    import jax

    return {"path": str(llm.model_path), "dtype": llm.dtype.name, "platform": jax.devices()[0].platform,
            "device": jax.devices()[0].device_kind, "config": dataclasses.asdict(llm.model_config)}


def start_engine(engine_args: EngineArgs, progress: bool):
    """The engine and its start-up time (loading and compiling every step bucket)."""
    from jaxengine.llm import LLM

    start = time.perf_counter()
    llm = LLM.from_engine_args(engine_args, progress=progress)
    llm.wait_until_compiled()           # measured steps must not share the cores with a compile
    return llm, time.perf_counter() - start


def sampling_params(args) -> dict:
    """What every request samples with, but its output length."""
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n == 1 else 1.0)
    return {"n": args.n, "temperature": temperature, "seed": args.seed, "ignore_eos": True}


def measure(llm, requests: list[BenchRequest], sampling: dict, progress: bool) -> dict:
    """Generate every request once; ``metrics``, per-request lengths (all sequences of a group),
    step traces and the first sequence's tokens."""
    params = [SamplingParams(**sampling, max_tokens=r.output_len) for r in requests]
    llm.engine.traces = []
    reset_runner_counters(llm.runner)
    with recording_step_ends(llm.engine) as ends:
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=progress)
        elapsed = time.perf_counter() - start
    traces = [{**dataclasses.asdict(t), "time_s": end - start} for t, end in zip(llm.engine.traces, ends)]
    tokens = [o.outputs[0].token_ids for o in outputs]
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [sum(len(c.token_ids) for c in o.outputs) for o in outputs]
    metrics = {**rates(len(requests), sum(prompt_lens), sum(output_lens), elapsed),
               **cache_and_step_figures(outputs, traces), **latency_figures(outputs)}
    if llm.engine_args.data_parallel_size == 1:        # the runner's counters are one replica's
        metrics.update(host_figures(llm.runner, elapsed, len(traces)))
    return {"metrics": metrics, "requests": {"prompt_lens": prompt_lens, "output_lens": output_lens},
            "traces": traces, "tokens": tokens}


def measure_beams(llm, requests: list[BenchRequest], width: int, progress: bool) -> dict:
    """Every request as a beam search (no EOS: each hypothesis has its full output length)."""
    from jaxengine.sampling_params import BeamSearchParams

    params = [BeamSearchParams(beam_width=width, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.engine.traces = []
    with recording_step_ends(llm.engine, kv_blocks(llm.engine.scheduler)) as ends:
        start = time.perf_counter()
        outputs = llm.beam_search([r.prompt_token_ids for r in requests], params, use_tqdm=progress)
        elapsed = time.perf_counter() - start
    traces = [{**dataclasses.asdict(t), "time_s": end - start, **blocks}
              for t, (end, blocks) in zip(llm.engine.traces, ends)]
    tokens = [[s.tokens[len(r.prompt_token_ids):] for s in o.sequences] for r, o in zip(requests, outputs)]
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [sum(map(len, t)) for t in tokens]
    metrics = {**rates(len(requests), sum(prompt_lens), sum(output_lens), elapsed),
               "num_steps": len(traces), "preemptions": sum(t["num_preemptions"] for t in traces),
               "blocks_swapped_out": sum(t["num_blocks_swapped_out"] for t in traces),
               "blocks_swapped_in": sum(t["num_blocks_swapped_in"] for t in traces),
               "prefix_cache_hit_rate": 0.0, "peak_kv_blocks": max(t["kv_blocks"] for t in traces),
               "peak_kv_blocks_copied": max(t["kv_blocks_copied"] for t in traces)}
    metrics["kv_blocks_saved"] = 1 - metrics["peak_kv_blocks"] / metrics["peak_kv_blocks_copied"]
    return {"metrics": metrics, "requests": {"prompt_lens": prompt_lens, "output_lens": output_lens},
            "traces": traces, "tokens": tokens}


def kv_blocks(scheduler):
    """After a step: the KV blocks held, and the blocks the running beams would hold if none were
    shared (each beam its own copy of every block of its tokens)."""
    kv = scheduler.kv

    def count() -> dict:
        held = kv.num_usable_blocks - kv.num_free_blocks
        copied = sum(cdiv(s.num_tokens, kv.block_size) for g in scheduler.running for s in g.live_seqs)
        return {"kv_blocks": held, "kv_blocks_copied": copied}

    return count


@contextlib.contextmanager
def recording_step_ends(engine, sample=None):
    """Within: ``ends`` gets the time each engine step returns (one per step trace), with
    ``sample()``'s value after it when given."""
    ends, step = [], engine.step

    def timed(*args, **kwargs):
        finished = step(*args, **kwargs)
        ends.append(time.perf_counter() if sample is None else (time.perf_counter(), sample()))
        return finished

    engine.step = timed
    try:
        yield ends
    finally:
        del engine.step                 # the class's method again


def reset_runner_counters(runner) -> None:
    runner.device_wait_s = runner.idle_s = 0.0
    runner.num_launches = runner.num_idle_launches = 0


def host_figures(runner, elapsed: float, num_steps: int) -> dict:
    """Host work per step (the time not spent waiting for the device's results), the share of
    steps launched onto an idle device, and the device's idle time before those launches."""
    return {"host_ms_per_step": (elapsed - runner.device_wait_s) / max(num_steps, 1) * 1e3,
            "idle_launch_fraction": runner.num_idle_launches / max(runner.num_launches, 1),
            "device_idle_s": runner.idle_s}


def rates(num_requests: int, prompt_tokens: int, output_tokens: int, seconds: float) -> dict:
    return {"num_requests": num_requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "elapsed_s": seconds, "requests_per_s": num_requests / seconds,
            "input_tokens_per_s": prompt_tokens / seconds, "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds}


def cache_and_step_figures(outputs, traces: list[dict]) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"cached_prompt_tokens": cached, "prefix_cache_hit_rate": cached / prompt_tokens,
            "num_steps": len(traces), "prefill_tokens": sum(t["num_prefill_tokens"] for t in traces),
            "tokens_computed": sum(t["num_prefill_tokens"] + t["num_decode_tokens"] for t in traces),
            "preemptions": sum(t["num_preemptions"] for t in traces),
            "blocks_swapped_out": sum(t["num_blocks_swapped_out"] for t in traces),
            "blocks_swapped_in": sum(t["num_blocks_swapped_in"] for t in traces),
            "peak_kv_usage": max((t["kv_usage"] for t in traces), default=0.0), **speculation_figures(traces)}


def speculation_figures(traces: list[dict]) -> dict:
    """Speculative decoding: draft tokens verified and accepted, the acceptance rate, and the mean
    acceptance length (tokens a drafted row output per step: its accepted drafts plus one); empty
    when no step carried a draft."""
    drafts = sum(t.get("num_drafts", 0) for t in traces)
    if not drafts:
        return {}
    proposed = sum(t["num_draft_tokens"] for t in traces)
    accepted = sum(t["num_accepted_tokens"] for t in traces)
    return {"draft_tokens": proposed, "accepted_tokens": accepted, "acceptance_rate": accepted / proposed,
            "mean_acceptance_length": 1 + accepted / drafts,
            "steps_speculation_off": sum(1 for t in traces if t.get("speculation_gain") == 1.0)}


def latency_figures(outputs) -> dict:
    """Per-request latencies in ms (every request arrives at the start: queueing included)."""
    m = [o.metrics for o in outputs]
    tpot = [(x.finished_time - x.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for x, o in zip(m, outputs) if len(o.outputs[0].token_ids) > 1]
    return {"ttft_ms": summarize(x.ttft * 1e3 for x in m),
            "tpot_ms": summarize(t * 1e3 for t in tpot),
            "e2e_latency_ms": summarize((x.finished_time - x.arrival_time) * 1e3 for x in m)}


def run_baseline(name: str, llm, requests: list[BenchRequest], args, engine_metrics: dict,
                 engine_tokens: list) -> dict:
    """One baseline on the same requests: its figures, jaxengine / baseline ratios, token agreement."""
    if name == "hf":
        from jaxengine.bench.hf_baseline import run_hf

        figures, tokens = run_hf(llm.model_path, requests, args.baseline_batch_size, args.progress,
                                 num_beams=max(args.beam_width, 1))
    elif name == "vllm":
        from jaxengine.bench.vllm_baseline import run_vllm

        figures, tokens = run_vllm(args.vllm_python, args.vllm_model or str(llm.model_path), requests,
                                   vllm_engine_options(llm, args), args.progress)
    elif name == "llamacpp":
        from jaxengine.bench.llamacpp_baseline import run_llamacpp

        sc = llm.config.scheduler
        figures, tokens = run_llamacpp(args.llamacpp_bin, args.llamacpp_model or str(llm.model_path), requests,
                                       sc.max_num_seqs, sc.max_model_len,
                                       args.llamacpp_threads or len(os.sched_getaffinity(0)), args.progress)
    else:
        from jaxengine.bench.naive_baseline import run_naive

        figures, tokens = run_naive(llm.model, requests, args.baseline_batch_size, args.progress)
    figures.update(rates(len(requests), engine_metrics["prompt_tokens"], engine_metrics["output_tokens"],
                         figures["elapsed_s"]))
    mismatched = sum(a != b for a, b in zip(engine_tokens, tokens))
    ratio = {k: engine_metrics[k] / figures[k] for k in ("requests_per_s", "output_tokens_per_s")}
    return {**figures, "ratio": ratio, "same_tokens": mismatched == 0, "mismatched_requests": mismatched}


def vllm_engine_options(llm, args) -> dict:
    """vLLM's LLM(...) with the engine's limits, dtype and prefix caching."""
    sc = llm.config.scheduler
    return {"dtype": llm.dtype.name, "max_model_len": sc.max_model_len,
            "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
            "enable_prefix_caching": llm.engine_args.enable_prefix_caching,
            "kv_cache_memory_bytes": args.vllm_kv_cache_bytes, "seed": 0}


def table_rows(result: dict) -> list[dict]:
    m = result["metrics"]
    rows = [{"run": "jaxengine", "req/s": m["requests_per_s"], "input tok/s": m["input_tokens_per_s"],
             "output tok/s": m["output_tokens_per_s"], "time s": m["elapsed_s"], "start-up s": m["startup_s"],
             "prefix hit rate": m["prefix_cache_hit_rate"], "preemptions": m["preemptions"],
             "swapped blocks": m["blocks_swapped_out"] + m["blocks_swapped_in"], "ratio": None,
             "same tokens": None}]
    if "mean_acceptance_length" in m:
        rows[0]["acceptance length"] = round(m["mean_acceptance_length"], 2)
    if "peak_kv_blocks" in m:
        rows[0]["peak KV blocks (copied)"] = f"{m['peak_kv_blocks']} ({m['peak_kv_blocks_copied']})"
    for name, b in result["baselines"].items():
        rows.append({"run": f"baseline {name}", "req/s": b["requests_per_s"],
                     "input tok/s": b["input_tokens_per_s"], "output tok/s": b["output_tokens_per_s"],
                     "time s": b["elapsed_s"], "start-up s": b.get("load_s", b.get("compile_s")),
                     "ratio": b["ratio"]["output_tokens_per_s"], "same tokens": b["same_tokens"]})
    return rows
