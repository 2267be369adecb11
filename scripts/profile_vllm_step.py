"""Where one vLLM (CPU build) engine step goes on the default model, per part: a peer's row for
the "where each step goes" table.

    LD_PRELOAD=<libtcmalloc_minimal.so.4> /work/peers/vllm-venv/bin/python \
        scripts/profile_vllm_step.py --model /work/peers/smollm2-hf --mode eager \
        --out /tmp/p51/peers/vllm_eager.json

Runs under vLLM's own interpreter (not jaxengine's venv). The model folder is the default model
exported in float32 by ``scripts/export_hf_checkpoint.py``. If tcmalloc is installed and not
already preloaded, the script re-executes itself with it in ``LD_PRELOAD``.

Shapes (each measured on fresh requests of random token ids, greedy, ``ignore_eos``):

* ``b1``      batch 1 decode; prompt ``ctx - warmup - steps/2`` tokens so that the measured
              decode steps' mean context is ``ctx`` (128 by default).
* ``b64``     64 sequences decoding together; measured only once every sequence's prefill is
              done (the 512-token budget prefills them over ~14 steps and early sequences start
              decoding meanwhile, so prompts are ``--b64-ctx-shift`` (7) tokens shorter to keep
              the measured mean context at ~``ctx``; the actual mean context is reported).
* ``p512``    one 512-token prompt with ``max_tokens=1``: one step = the whole prefill + the
              sampling of its first token.

Engine: offline ``LLM`` with dtype float32, max_model_len 1024, kv_cache_memory_bytes 1 GiB,
max_num_seqs 64, max_num_batched_tokens 512, prefix caching off, seed 0; ``--mode eager`` sets
``enforce_eager=True``, ``--mode compiled`` leaves vLLM's CPU default (Dynamo trace once +
Inductor). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core, scheduler and model in
this process (on CPU the default would spawn a worker process and, on this 2-core machine,
reserve one core for the scheduler, leaving the model one OpenMP thread), so the model runs
with ``OMP_NUM_THREADS=2`` (unless set) and one ``torch.profiler`` sees the whole step.
``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`` turns on vLLM's own ``record_function`` scopes
("gpu_model_runner: forward" / "postprocess" / "sample"), which the split relies on.

Each shape is run three times on fresh requests: unprofiled, under the profiler, unprofiled again
(``--steps`` steps each, timed with ``perf_counter`` around ``LLMEngine.step()``; the wall ms/step
is the median of the two unprofiled runs), the middle one under ``torch.profiler`` (CPU activity, shapes
recorded) for the split. Per step (mean over the profiled steps, ms):

* ``matmul``    the projection + MLP matmuls of all layers: top-level ops in the forward scope
                named like a GEMM (``_C::onednn_mm``, ``aten::linear/mm/addmm``, sgl
                ``weight_packed_linear``, zentorch) - call count per step is reported (120 = 30
                layers x qkv/o/gate_up/down).
* ``attention`` top-level ops in the forward scope whose name has attention/attn/kv_cache
                (``vllm::unified_attention_with_output``, ``vllm::unified_kv_cache_update``, the
                ``_C::cpu_attn*`` kernels): the KV write and the attention itself.
* ``lm_head``   GEMM ops in the postprocess scope (``compute_logits``: the tied-embedding
                logits matmul, 49152 wide).
* ``sampler``   the whole "gpu_model_runner: sample" scope (its ops and its Python).
* ``other``     the rest of the forward scope: norms, rope, SiLU-and-mul, residual adds,
                embedding lookup, and (reported separately as ``other_gaps``) the time inside the
                forward when no op runs (module-call Python, Dynamo guards); in compiled mode
                Inductor's fused C++ kernels carry no profiler events, so they land in the gaps.
                Non-GEMM ops of the postprocess scope (the row gather) are added to ``other``.
                With ``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`` in the environment (compiled
                mode), Inductor's kernels get profiler events (``graph_0_cpp_fused_*``, named after
                the ops they fused, so never counted as GEMMs) and are reported as ``other_fused``;
                that flag adds a little per-kernel overhead, so take the wall from a run without it.
* ``host``      the step's wall time minus all of the above: scheduler, input preparation,
                attention metadata, output processing/detokenization, engine bookkeeping.

The profiler's own per-op cost inflates the profiled wall (both walls are reported); the raw
chrome trace and the op table of each shape are written next to ``--out``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import time


def _reexec_with_tcmalloc() -> None:
    """Preload tcmalloc (vLLM's CPU recommendation) by re-executing once, if it is installed."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload or os.environ.get("P51_NO_REEXEC"):
        return
    candidates = glob.glob("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4") + glob.glob(
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    if not candidates:
        print("tcmalloc not found; running without it", file=sys.stderr)
        return
    os.environ["LD_PRELOAD"] = ":".join(p for p in (candidates[0], preload) if p)
    os.environ["P51_NO_REEXEC"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])


_reexec_with_tcmalloc()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

FWD, POST, SAMPLE = "gpu_model_runner: forward", "gpu_model_runner: postprocess", "gpu_model_runner: sample"
STEP = "p51_step"
GEMM = re.compile(r"onednn_mm|aten::(linear|mm|addmm|matmul|bmm)$|weight_packed_linear|zentorch_linear|mkldnn_linear")
ATTN = re.compile(r"attention|attn|kv_cache")
FUSED = re.compile(r"cpp_fused|triton_")


def dur(ev) -> float:
    """An event's duration in ms."""
    return (ev.time_range.end - ev.time_range.start) / 1e3


def split_step(step_ev) -> dict:
    """The per-part split of one profiled step (ms), see the module docstring."""
    acc = dict(wall=dur(step_ev), matmul=0.0, attention=0.0, lm_head=0.0, sampler=0.0, sampler_ops=0.0,
               other_ops=0.0, other_fused=0.0, forward=0.0, post=0.0, n_matmul=0, n_attention=0, n_lm_head=0)

    def top_ops(ev):
        """Outermost op events under ``ev`` (descending through scopes/compiled-region wrappers)."""
        for ch in ev.cpu_children:
            if ch.name.startswith(("gpu_model_runner", "llm_engine", STEP)) or ch.name.startswith(
                    ("Torch-Compiled", "CompiledFunction", "TorchDynamo", "## ", "Dynamo")):
                yield from top_ops(ch)
            elif FUSED.search(ch.name) or GEMM.search(ch.name) or ATTN.search(ch.name):
                yield ch
            elif ch.cpu_children and not ch.name.startswith(("aten::", "_C::", "vllm::")):
                # a non-op annotation (e.g. a python scope): look inside
                yield from top_ops(ch)
            else:
                yield ch

    def walk(ev):
        for ch in ev.cpu_children:
            if ch.name == FWD:
                acc["forward"] += dur(ch)
                for op in top_ops(ch):
                    if FUSED.search(op.name):  # Inductor kernel: named after the ops it fused, mm included
                        acc["other_fused"] += dur(op); acc["other_ops"] += dur(op)
                    elif GEMM.search(op.name):
                        acc["matmul"] += dur(op); acc["n_matmul"] += 1
                    elif ATTN.search(op.name):
                        acc["attention"] += dur(op); acc["n_attention"] += 1
                    else:
                        acc["other_ops"] += dur(op)
            elif ch.name == POST:
                acc["post"] += dur(ch)
                for op in top_ops(ch):
                    if GEMM.search(op.name) and not FUSED.search(op.name):
                        acc["lm_head"] += dur(op); acc["n_lm_head"] += 1
                    else:
                        acc["post_other_ops"] = acc.get("post_other_ops", 0.0) + dur(op)
            elif ch.name == SAMPLE:
                acc["sampler"] += dur(ch)
                acc["sampler_ops"] += sum(dur(op) for op in top_ops(ch))
            else:
                walk(ch)

    walk(step_ev)
    post_other = acc.pop("post_other_ops", 0.0)
    acc["other_gaps"] = acc["forward"] - acc["matmul"] - acc["attention"] - acc["other_ops"]
    acc["other"] = acc["forward"] - acc["matmul"] - acc["attention"] + post_other
    acc["host"] = acc["wall"] - acc["matmul"] - acc["attention"] - acc["lm_head"] - acc["sampler"] - acc["other"]
    return acc


def make_llm(args):
    from vllm import LLM
    return LLM(model=args.model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 30,
               enforce_eager=args.mode == "eager", max_num_seqs=64, max_num_batched_tokens=512,
               enable_prefix_caching=False, seed=0)


class Driver:
    """Adds requests to the in-process ``LLMEngine`` and steps it, timing each step."""

    def __init__(self, llm, seed: int = 0):
        self.eng = llm.llm_engine
        self.rng = np.random.default_rng(seed)
        self.n = 0
        self.generated: dict[str, int] = {}

    def add(self, prompt_len: int, max_tokens: int) -> str:
        from vllm import SamplingParams
        rid = f"r{self.n}"
        self.n += 1
        ids = self.rng.integers(1000, 40000, prompt_len).tolist()
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.eng.add_request(rid, {"prompt_token_ids": ids}, sp)
        self.generated[rid] = 0
        return rid

    def step(self) -> tuple[float, int]:
        """One engine step: (seconds, number of requests that got a token)."""
        with record_function(STEP):
            t0 = time.perf_counter()
            outs = self.eng.step()
            dt = time.perf_counter() - t0
        for o in outs:
            self.generated[o.request_id] = len(o.outputs[0].token_ids)
        return dt, len(outs)

    def drain(self):
        while self.eng.has_unfinished_requests():
            self.eng.step()
        self.generated.clear()


def run_decode(drv: Driver, batch: int, prompt_len: int, warmup: int, steps: int, prof_path: str | None):
    """Prefill ``batch`` prompts, ``warmup`` decode steps, then ``steps`` measured decode steps."""
    rids = [drv.add(prompt_len, warmup + steps + 80) for _ in range(batch)]
    prefill_steps = 0
    while min(drv.generated[r] for r in rids) < 1:
        drv.step(); prefill_steps += 1
    for _ in range(warmup):
        drv.step()
    ctx = statistics.mean(prompt_len + drv.generated[r] for r in rids) + (steps + 1) / 2
    times, prof = [], None
    if prof_path:
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        prof.__enter__()
    for _ in range(steps):
        dt, n = drv.step()
        assert n == batch, f"expected a pure decode step of {batch}, got {n} outputs"
        times.append(dt)
    if prof:
        prof.__exit__(None, None, None)
    drv.drain()
    return times, prof, dict(prefill_steps=prefill_steps, mean_context=ctx)


def run_prefill(drv: Driver, prompt_len: int, warmup: int, steps: int, prof_path: str | None):
    """``warmup`` + ``steps`` single-request prefill steps (``max_tokens=1``), the last timed."""
    times, prof = [], None
    for i in range(warmup + steps):
        if i == warmup and prof_path:
            prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            prof.__enter__()
        drv.add(prompt_len, 1)
        dt, n = drv.step()
        assert n == 1 and not drv.eng.has_unfinished_requests(), "prefill did not finish in one step"
        if i >= warmup:
            times.append(dt)
    if prof:
        prof.__exit__(None, None, None)
    drv.generated.clear()
    return times, prof, dict(mean_context=prompt_len)


def summarize(prof, out_prefix: str) -> dict:
    events = prof.events()
    steps = [ev for ev in events if ev.name == STEP]
    splits = [split_step(ev) for ev in steps]
    keys = splits[0].keys()
    mean = {k: statistics.mean(s[k] for s in splits) for k in keys}
    prof.export_chrome_trace(out_prefix + ".trace.json")
    with open(out_prefix + ".ops.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        f.write("\n\nby input shape (top 40 by total):\n")
        f.write(prof.key_averages(group_by_input_shape=True).table(sort_by="cpu_time_total", row_limit=40))
    return dict(profiled_steps=len(steps), split_ms=mean)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/work/peers/smollm2-hf")
    p.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    p.add_argument("--shapes", default="b1,b64,p512")
    p.add_argument("--ctx", type=int, default=128, help="mean context of the measured decode steps")
    p.add_argument("--steps", type=int, default=32, help="measured decode steps")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prefill-steps", type=int, default=8)
    p.add_argument("--b64-ctx-shift", type=int, default=7,
                   help="prompt tokens fewer at b64 so the measured mean context stays ~ctx")
    p.add_argument("--out", default="/tmp/p51/peers/vllm.json")
    args = p.parse_args()

    t0 = time.perf_counter()
    llm = make_llm(args)
    startup = time.perf_counter() - t0
    drv = Driver(llm)
    # whole-engine warm-up: one of each shape, discarded
    drv.add(512, 4); drv.drain()
    for _ in range(8):
        drv.add(64, 4)
    drv.drain()

    prompt_len = args.ctx - args.warmup - round((args.steps + 1) / 2)
    result = dict(mode=args.mode, torch=torch.__version__, threads=torch.get_num_threads(),
                  ld_preload=os.environ.get("LD_PRELOAD", ""), startup_s=startup, shapes={})
    import vllm
    result["vllm"] = vllm.__version__
    prefix = os.path.splitext(args.out)[0]
    for shape in args.shapes.split(","):
        if shape in ("b1", "b64"):
            batch = 1 if shape == "b1" else 64
            # at b64 the 512-token budget prefills the 64 prompts over ~14 steps while the early
            # ones already decode: they enter the measured window ~7 tokens further on average
            plen = prompt_len - (args.b64_ctx_shift if batch == 64 else 0)
            run = lambda prof_path: run_decode(drv, batch, plen, args.warmup, args.steps, prof_path)  # noqa: E731
        elif shape.startswith("p"):
            n = int(shape[1:])
            run = lambda prof_path: run_prefill(drv, n, 2, args.prefill_steps, prof_path)  # noqa: E731
        else:
            raise SystemExit(f"unknown shape {shape}")
        times, _, info = run(None)
        ptimes, prof, pinfo = run(f"{prefix}_{shape}")
        times_after, _, _ = run(None)
        both = times + times_after
        entry = dict(info, wall_ms_median=1e3 * statistics.median(both), wall_ms_mean=1e3 * statistics.mean(both),
                     wall_ms_median_before=1e3 * statistics.median(times),
                     wall_ms_median_after=1e3 * statistics.median(times_after),
                     wall_ms_profiled_median=1e3 * statistics.median(ptimes),
                     wall_ms_all=[1e3 * t for t in both], profiled_mean_context=pinfo["mean_context"])
        entry.update(summarize(prof, f"{prefix}_{shape}"))
        result["shapes"][shape] = entry
        s = entry["split_ms"]
        print(f"[{args.mode} {shape}] wall {entry['wall_ms_median']:.2f} ms (before {entry['wall_ms_median_before']:.2f} after {entry['wall_ms_median_after']:.2f} profiled {s['wall']:.2f}) | host {s['host']:.2f} "
              f"matmul {s['matmul']:.2f} ({s['n_matmul']:.0f}) attn {s['attention']:.2f} lm_head {s['lm_head']:.2f} "
              f"sampler {s['sampler']:.2f} other {s['other']:.2f} (gaps {s['other_gaps']:.2f})", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
