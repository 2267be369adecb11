"""GPU benchmarks for scripts/gpu_check.sh (``--smoke``: tiny sizes, runs on the CPU too).

    python scripts/bench_gpu.py ceilings|kernel|engine|moe|quantized --out DIR [--smoke]

ceilings: HBM copy bandwidth and bf16 matmul rate, measured here (the baselines).
kernel:   the two Pallas ragged paged-attention kernels (Triton-lowered; Mosaic GPU on Hopper)
          against the plain-jnp path (outputs compared and timed) and the copy bandwidth, on a
          decode batch (256 requests x 2k context, Llama-3-8B heads: 32 query, 8 KV, head size
          128, bf16) and a mixed batch, with JAX's own decode-only Pallas kernel as a yardstick on
          the decode batch; the KV write (outputs compared with the XLA scatter's); block-size
          sweeps of both kernels for the decode case.
engine:   the engine end to end on a random-weight model of Llama-3-8B shape (bf16) with the
          attention kernel and KV write that measured faster among those whose outputs matched the
          plain-jnp path's in the kernel part, at the sweeps' best (matching) block sizes:
          offline throughput for 1,000 requests of 128 prompt / 128 output tokens (ignore_eos),
          and the decode step time at batch 256 against its roofline floor.
moe, quantized: a mixture-of-experts layer; quantized weights' matmul against bf16 (into kernel.json).
speculation, lora: the 8B model's verify step; its step with 8 LoRA adapters against none (into kernel.json).
Each writes DIR/<name>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.costmodel.floors import step_floor_seconds
from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled, write_kv
from jaxengine.kernels.paged_attention.kernel import BlockSizes, block_sizes, paged_attention_pallas
from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas
from jaxengine.kernels.paged_attention.mosaic_kernel import paged_attention_mosaic
from jaxengine.runner.kernel_check import attention_error

KERNELS = {"pallas": paged_attention_pallas, "mosaic": paged_attention_mosaic}     # Triton, Mosaic GPU


def timed(fn, *args, reps: int = 10) -> float:
    """Median seconds per call after a warm-up call (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- ceilings
def ceilings(smoke: bool) -> dict:
    n = (1 << 20) if smoke else (1 << 30)                   # bf16 elements: 2 GiB on the GPU
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    t_copy = timed(copy, x)
    m = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    t_mm = timed(mm, a)
    # Three significant figures: a dry run's small rates must not round to zero (they divide).
    return {"copy_bandwidth_gbs": float(f"{2 * n * 2 / t_copy / 1e9:.3g}"),
            "bf16_matmul_tflops": float(f"{2 * m ** 3 / t_mm / 1e12:.3g}")}


# ---------------------------------------------------------------- kernel
def attention_batch(rows, page_size, kv_heads, group, head_size, dtype, seed=0):
    """rows: (context before, new tokens). Random caches with each row's pages scattered."""
    rng = np.random.default_rng(seed)
    pages_per_row = [-(-(c + n) // page_size) for c, n in rows]
    num_pages = sum(pages_per_row) + 1
    perm = rng.permutation(np.arange(1, num_pages))
    tables, used = [], 0
    for count in pages_per_row:
        tables.append(perm[used:used + count].tolist())
        used += count
    num_tokens = sum(n for _, n in rows)
    md = AttentionMetadata.build([(c, n, t) for (c, n), t in zip(rows, tables)], page_size, num_tokens,
                                 max(pages_per_row))
    key = jax.random.key(seed)
    shape = (num_pages, page_size, kv_heads, head_size)
    k = jax.random.normal(key, shape, dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), shape, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (num_tokens, kv_heads * group, head_size), dtype)
    kv_bytes = sum(c + n for c, n in rows) * kv_heads * head_size * 2 * jnp.dtype(dtype).itemsize
    return q, k, v, md, kv_bytes


def interpret_mosaic() -> None:
    """A dry run on the CPU: Mosaic GPU's interpreter needs the tests' patch, held from here on
    (the patch ends when its context is collected)."""
    global _INTERPRETER_PATCH
    if _INTERPRETER_PATCH is None:
        from tests.kernels.mosaic_interpret import transposed_wgmma_operands

        _INTERPRETER_PATCH = transposed_wgmma_operands()
        _INTERPRETER_PATCH.__enter__()


_INTERPRETER_PATCH = None


def kernel(smoke: bool, copy_gbs: float, save) -> dict:
    """``save(results)`` after each part, so a part cut short by the time limit keeps the others."""
    heads = (2, 4, 64) if smoke else (8, 4, 128)            # KV heads, group, head size
    context, batch = (64, 8) if smoke else (2048, 256)
    cases = {"decode": [(context - 1, 1)] * batch,
             "mixed": [(context - 1, 1)] * (batch // 2) + [(context // 2, context // 4)] * 4}
    if jax.devices()[0].platform == "cpu":
        interpret_mosaic()
    out = {}
    for name, rows in cases.items():
        out[name] = kernel_case(rows, heads, copy_gbs, lambda part: save({**out, name: part}))
        save(out)
    for key, name, sizes in (("decode_sweep", "pallas", triton_sizes(heads)),
                             ("decode_sweep_mosaic", "mosaic", mosaic_sizes())):
        out[key] = sweep(cases["decode"], heads, copy_gbs, name, sizes, lambda part: save({**out, key: part}))
    return out


def kernel_case(rows, heads, copy_gbs: float, save) -> dict:
    """Each Pallas kernel vs the plain-jnp path on one batch (JAX's decode kernel too, on a decode
    batch), and the KV write. A kernel that fails is recorded and the rest measured; ``save`` after
    each, and the Mosaic kernel (the one a hang would most likely come from) last."""
    q, k, v, md, kv_bytes = attention_batch(rows, 16, *heads, jnp.bfloat16)
    reference = jax.jit(lambda q, k, v, md: paged_attention_tiled(q, k, v, md, scale=0.088))
    t_ref = timed(reference, q, k, v, md)
    want = oracle(q, k, v, md)
    result = {"reference_ms": round(t_ref * 1e3, 3), "kv_gb": round(kv_bytes / 1e9, 3)}
    result.update(attention_times("pallas", (q, k, v, md), want, t_ref, kv_bytes, copy_gbs))
    save(result)
    if all(n == 1 for _, n in rows):
        result.update(jax_decode_kernel(q, k, v, md, want, t_ref, kv_bytes, copy_gbs))
        save(result)
    result.update(kv_write_times(rows, heads))
    save(result)
    result.update(attention_times("mosaic", (q, k, v, md), want, t_ref, kv_bytes, copy_gbs))
    if "pallas_ms" in result and "mosaic_ms" in result:
        result["mosaic_speedup_vs_pallas"] = round(result["pallas_ms"] / result["mosaic_ms"], 2)
    return result


def oracle(q, k, v, md):
    """The plain-jnp path's output at full f32 precision: what every kernel must match."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda q, k, v, md: paged_attention_tiled(q, k, v, md, scale=0.088))(q, k, v, md)


def attention_times(name: str, args, want, t_ref: float, kv_bytes: int, copy_gbs: float) -> dict:
    """Time one kernel and check its output against ``want`` (the engine's start-up check's
    tolerance): only a kernel whose outputs matched is chosen for the engine run."""
    fn = jax.jit(lambda q, k, v, md: KERNELS[name](q, k, v, md, scale=0.088))
    try:
        t = timed(fn, *args)
        err, limit = attention_error(fn(*args), want, args[0].dtype)
    except Exception as error:      # noqa: BLE001 - record it, measure the rest
        return {f"{name}_error": f"{type(error).__name__}: {str(error)[:300]}", f"{name}_matches": False}
    gbs = kv_bytes / t / 1e9
    return {f"{name}_ms": round(t * 1e3, 3), f"{name}_speedup_vs_reference": round(t_ref / t, 2),
            f"{name}_gbs": round(gbs, 1), f"{name}_fraction_of_copy_bw": round(gbs / copy_gbs, 3),
            f"{name}_max_abs_err_vs_reference": err, f"{name}_matches": err <= limit}


def kv_write_times(rows, heads) -> dict:
    """The batch's new K/V rows written in place (donated caches of their own): the XLA scatter,
    and the Pallas kernel at its table's and other block sizes. Each writer's first output is
    compared with the XLA scatter's (not donated, so both start from the same caches): it must be
    the same bit for bit outside the null block, or the writer is not chosen."""
    q, k, v, md, _ = attention_batch(rows, 16, *heads, jnp.bfloat16, seed=1)
    new_kv = jax.random.normal(jax.random.key(3), (q.shape[0], heads[0], heads[2]), jnp.bfloat16)
    want = jax.jit(write_kv)(k, v, new_kv, new_kv, md.slot_mapping)
    writers = [("xla_scatter", write_kv), ("pallas", write_kv_pallas)] + [
        (f"pallas_{n}_tokens", functools.partial(write_kv_pallas, block_tokens=n)) for n in (8, 32, 64)]
    result = {}
    for name, write_fn in writers:
        k, v = attention_batch(rows, 16, *heads, jnp.bfloat16, seed=1)[1:3]
        write = jax.jit(lambda k, v, md, f=write_fn: f(k, v, new_kv, new_kv, md.slot_mapping), donate_argnums=(0, 1))
        try:
            k, v = write(k, v, md)                           # compile and check; then time in place
            result[f"kv_write_{name}_matches"] = bool(jnp.array_equal(k[1:], want[0][1:]) &
                                                      jnp.array_equal(v[1:], want[1][1:]))
            start = time.perf_counter()
            for _ in range(10):
                k, v = write(k, v, md)
            jax.block_until_ready(k)
        except Exception as error:      # noqa: BLE001 - record it, measure the rest
            result[f"kv_write_{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            result[f"kv_write_{name}_matches"] = False
            continue
        result[f"kv_write_{name}_ms"] = round((time.perf_counter() - start) / 10 * 1e3, 3)
    return result


def jax_decode_kernel(q, k, v, md, want, t_ref, kv_bytes, copy_gbs) -> dict:
    """JAX's own decode-only paged attention (Pallas, Triton lowering; pages laid out [K, P, S, H]
    and split-K over 16 partitions by default) on the same decode batch: an outside yardstick."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    width = md.block_tables.shape[1]
    splits = min(16, width)
    k_pages, v_pages = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))
    fn = jax.jit(lambda q, kp, vp, tables, lengths: jax_paged_attention(
        q * 0.088, kp, vp, tables, lengths, k_splits=splits, pages_per_compute_block=min(8, width // splits),
        interpret=jax.devices()[0].platform == "cpu"))
    args = (q, k_pages, v_pages, md.block_tables, md.seq_lens)
    try:
        t = timed(fn, *args)
        err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
    except Exception as error:      # noqa: BLE001 - record it, measure the rest
        return {"jax_decode_error": f"{type(error).__name__}: {str(error)[:300]}"}
    gbs = kv_bytes / t / 1e9
    return {"jax_decode_ms": round(t * 1e3, 3), "jax_decode_fraction_of_copy_bw": round(gbs / copy_gbs, 3),
            "jax_decode_max_abs_err_vs_reference": err, "jax_decode_speedup_vs_reference": round(t_ref / t, 2)}


def triton_sizes(heads) -> list[BlockSizes]:
    base = block_sizes(heads[2], 16, jnp.bfloat16, heads[1])
    return [BlockSizes(base.block_q, pages, warps, stages)
            for pages in (1, 2, 4, 8) for warps in (4, 8) for stages in (1, 2, 3)]


def mosaic_sizes() -> list[BlockSizes]:
    return [BlockSizes(64, pages, num_stages=stages) for pages in (4, 8, 16) for stages in (2, 3, 4)]


def sweep(rows, heads, copy_gbs, name: str, candidates: list[BlockSizes], save) -> list[dict]:
    """Decode timings over block sizes (to update the kernel's TUNED table), fastest first;
    ``save(results so far)`` after each."""
    q, k, v, md, kv_bytes = attention_batch(rows, 16, *heads, jnp.bfloat16)
    want = oracle(q, k, v, md)
    results = []
    for sizes in candidates:
        fn = jax.jit(lambda q, k, v, md, s=sizes: KERNELS[name](q, k, v, md, scale=0.088, sizes=s))
        try:
            t = timed(fn, q, k, v, md, reps=5)
            err, limit = attention_error(fn(q, k, v, md), want, q.dtype)
        except Exception as error:                     # noqa: BLE001 - a size the compiler refuses
            results.append({"sizes": sizes.__dict__, "error": str(error)[:200]})
            continue
        results.append({"sizes": sizes.__dict__, "ms": round(t * 1e3, 3), "matches": err <= limit,
                        "fraction_of_copy_bw": round(kv_bytes / t / 1e9 / copy_gbs, 3)})
        save(sorted(results, key=lambda r: r.get("ms", 1e9)))
    return sorted(results, key=lambda r: r.get("ms", 1e9))


def use_best_sizes(out: Path, head_size: int, page_size: int) -> dict:
    """Put each sweep's fastest sizes whose outputs matched into its kernel's TUNED table for this
    layout (bf16), so the engine run of the same call uses tuned kernels. Returns what it set."""
    from jaxengine.kernels.paged_attention import kernel as triton_kernel, mosaic_kernel

    try:
        sweeps = json.loads((out / "kernel.json").read_text())
    except (OSError, ValueError):
        return {}
    chosen = {}
    for key, module in (("decode_sweep", triton_kernel), ("decode_sweep_mosaic", mosaic_kernel)):
        best = next((r["sizes"] for r in sweeps.get(key, []) if r.get("matches")), None)
        if best:
            layout = (head_size, page_size, "bfloat16")
            block_q = module.TUNED[layout].block_q        # the sweep kept the table's block_q
            module.TUNED[layout] = BlockSizes(block_q, best["pages_per_block"], best["num_warps"], best["num_stages"])
            chosen[key] = module.TUNED[layout].__dict__
    return chosen


def kernel_cases(out: Path) -> list[dict]:
    """The decode and mixed batches' results of this run's kernel benchmark ([] if it did not run)."""
    try:
        results = json.loads((out / "kernel.json").read_text())
    except (OSError, ValueError):
        return []
    return [results[name] for name in ("decode", "mixed") if name in results]


def matched(cases: list[dict], key: str) -> bool:
    """Whether ``key``'s outputs matched the plain-jnp path's in every batch of this run."""
    return bool(cases) and all(c.get(f"{key}_matches") is True for c in cases)


def faster_kv_write(out: Path) -> str:
    """``pallas`` if the Pallas KV write matched the XLA scatter's output and measured faster over
    the decode and mixed batches together, else ``xla_scatter``."""
    cases = kernel_cases(out)
    if not matched(cases, "kv_write_pallas"):
        return "xla_scatter"
    pallas = sum(c["kv_write_pallas_ms"] for c in cases)
    scatter = sum(c["kv_write_xla_scatter_ms"] for c in cases)
    return "pallas" if pallas < scatter else "xla_scatter"


def faster_kernel(out: Path) -> str:
    """The attention backend for the engine run: of the Pallas kernels whose outputs matched the
    plain-jnp path's in this run, the one that measured faster on the decode batch; the plain-jnp
    path (``reference``) if none did or the kernel benchmark did not run."""
    cases = kernel_cases(out)
    names = {"pallas": "pallas-triton", "mosaic": "pallas-mosaic"}
    times = {backend: cases[0][f"{key}_ms"] for key, backend in names.items() if matched(cases, key)}
    return min(times, key=times.get) if times else "reference"


# ---------------------------------------------------------------- engine
ENGINE_LAYOUT = (128, 16)           # the engine run's head size and page (block) size


def llama3_8b(smoke: bool):
    from jaxengine.models.config import ModelConfig, RopeScaling

    if smoke:
        return ModelConfig("LlamaForCausalLM", 512, 128, 256, 2, 4, 2, 32, rope_theta=500000.0)
    return ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                       max_position_embeddings=8192)


def engine(smoke: bool, ceil: dict, backend: str, kv_write: str, tuned: dict) -> dict:
    from flax import nnx

    from jaxengine import SamplingParams
    from jaxengine.kernels.paged_attention.backend import select_attention
    from jaxengine.llm import LLM
    from jaxengine.models.llama import LlamaForCausalLM

    cfg = llama3_8b(smoke)
    start = time.perf_counter()
    if jax.devices()[0].platform == "cpu":                # a dry run: the kernels would be interpreted
        backend, kv_write = "reference", "xla_scatter"
    model = LlamaForCausalLM(cfg, jnp.bfloat16, select_attention(backend), rngs=nnx.Rngs(0))
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    init_s = time.perf_counter() - start
    num_requests, batch = (32, 16) if smoke else (1000, 256)
    budget = 256 if smoke else 4096
    start = time.perf_counter()
    options = dict(model_config=cfg, dtype="bfloat16", max_num_seqs=batch, max_num_batched_tokens=budget,
                   max_model_len=512, block_size=16, token_buckets=sorted({batch, 1024 if not smoke else 64, budget}),
                   # one row bucket: fewer start-up compilations of an 8B model (a part of the
                   # time limit); the workload's tail pays nothing for it, decode being weight-bound
                   request_buckets=[batch], enable_prefix_caching=False,
                   num_kv_blocks=256 if smoke else 8192)
    failures = {}
    # One GPU run: if a kernel fails to compile in the model, still measure the engine without it.
    # Only kernels whose outputs matched in this run's kernel benchmark are tried.
    for backend, kv_write in dict.fromkeys([(backend, kv_write), (backend, "xla_scatter"),
                                            ("reference", "xla_scatter")]):
        model.layers.self_attn.attention_fn = select_attention(backend)
        model.layers.self_attn.kv_write_fn = write_kv_pallas if kv_write == "pallas" else write_kv
        try:
            llm = LLM(model, **options)
            llm.wait_until_compiled()
            break
        except Exception as error:          # noqa: BLE001 - recorded; the next pair is tried
            failures[f"{backend} + {kv_write}"] = f"{type(error).__name__}: {str(error)[:300]}"
    compile_s = time.perf_counter() - start
    attention = model.layers.self_attn          # as the engine's start-up kernel check left it
    after_check = [getattr(fn, "__name__", repr(fn)) for fn in (attention.attention_fn, attention.kv_write_fn)]
    steps = record_steps(llm)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, 128).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    decode = [s for s in steps if s["decode"] == batch and s["prefill"] == 0]
    result = {"attention_backend": backend, "kv_write": kv_write, "failed_backends": failures,
              "kernels_after_start_up_check": after_check,
              "block_sizes_from_sweeps": tuned,
              "num_params": int(num_params), "init_s": round(init_s, 1), "startup_compile_s": round(compile_s, 1),
              "requests": num_requests, "output_tokens": tokens, "seconds": round(seconds, 2),
              "output_tok_s": round(tokens / seconds, 1), "steps": len(steps),
              "host_s_per_step": round((sum(s["wall"] for s in steps) - llm.runner.device_wait_s) / max(len(steps), 1), 5)}
    if decode:
        result["decode_step_ms_at_batch"] = round(statistics.median(s["wall"] for s in decode) * 1e3, 3)
        result["decode_floor_ms"] = round(decode_floor_ms(cfg, num_params, batch,
                                                          statistics.median(s["context"] for s in decode), ceil), 3)
        result["decode_vs_floor"] = round(result["decode_step_ms_at_batch"] / result["decode_floor_ms"], 2)
    return result


def record_steps(llm) -> list[dict]:
    """Wrap engine.step to time each step and note its shape and total context."""
    steps, engine, original = [], llm.engine, llm.engine.step

    def step(*args, **kwargs):
        start = time.perf_counter()
        finished = original(*args, **kwargs)
        trace = engine.last_trace
        context = sum(len(s.token_ids) for g in engine.scheduler.running for s in g.seqs)
        steps.append({"wall": time.perf_counter() - start, "decode": trace.num_decode_tokens,
                      "prefill": trace.num_prefill_tokens, "context": context})
        return finished

    engine.step = step
    return steps


def decode_floor_ms(cfg, num_params: int, batch: int, context: float, ceil: dict) -> float:
    """The roofline of one bf16 decode step of ``batch`` rows attending to ``context`` tokens in
    all, at the copy bandwidth and matmul rate measured in this run."""
    return step_floor_seconds(cfg, num_params, batch, context, context, bytes_per_param=2,
                              bandwidth_bytes_s=ceil["copy_bandwidth_gbs"] * 1e9,
                              flops_per_s=ceil["bf16_matmul_tflops"] * 1e12) * 1e3


# ---------------------------------------------------------------- moe
def moe(smoke: bool, copy_gbs: float, matmul_tflops: float, save_part=lambda result: None) -> dict:
    """A Qwen3-30B-A3B expert layer (bf16, 128 experts, top 8) at decode batches and a prefill:
    the grouped matmul's achieved TFLOP/s and weight-read bandwidth (the experts its tokens
    touch), whether XLA kept ``ragged_dot`` or rewrote it densely, and the dense reference; and
    the layer with its experts kept quantized (fp8, int4) against it."""
    from flax import nnx

    from jaxengine.models.config import ModelConfig
    from jaxengine.models.moe import SparseMoeBlock, dense_reference, route

    d, e, k, f = (64, 8, 2, 32) if smoke else (2048, 128, 8, 768)
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=d, intermediate_size=f,
                      num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16, num_experts=e, num_experts_per_tok=k,
                      moe_intermediate_size=f)
    block = SparseMoeBlock(cfg, jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(block)
    grouped = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
    reference = jax.jit(lambda s, x: dense_reference(nnx.merge(graphdef, s), x))
    x1 = jnp.ones((1, d), jnp.bfloat16)
    hlo = grouped.lower(state, x1).compile().as_text()
    result = {"shape": {"hidden": d, "experts": e, "top_k": k, "expert_width": f},
              "hlo_keeps_ragged_dot": "ragged-dot" in hlo or "ragged_dot" in hlo, "rows": []}
    for tokens in ((1, 16, 64) if smoke else (1, 16, 64, 256, 4096)):
        x = jax.random.normal(jax.random.key(tokens), (tokens, d), jnp.bfloat16)
        t = timed(grouped, state, x)
        _, chosen = route(x @ block.router[...], k, True)
        touched = len(set(jax.device_get(chosen).ravel().tolist()))
        weight_bytes = touched * 3 * d * f * 2
        row = {"tokens": tokens, "ms": round(t * 1e3, 4), "experts_touched": touched,
               "tflops": float(f"{2 * tokens * k * 3 * d * f / t / 1e12:.3g}"),
               "weight_read_gbs": float(f"{weight_bytes / t / 1e9:.3g}"),
               "fraction_of_copy_bw": float(f"{weight_bytes / t / 1e9 / copy_gbs:.3g}"),
               "fraction_of_matmul": float(f"{2 * tokens * k * 3 * d * f / t / 1e12 / matmul_tflops:.3g}")}
        if tokens == 64:
            row["dense_reference_ms"] = round(timed(reference, state, x) * 1e3, 4)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    save_part(result)
    # 16 of the experts: the host-side quantization of all 128 would take most of the part's time
    few = SparseMoeBlock(cfg.replace(num_experts=min(e, 16)), jnp.bfloat16, rngs=nnx.Rngs(0))
    result["quantized_experts"] = quantized_experts(few, (16,) if smoke else (16, 256))
    return result


def quantized_experts(block, token_counts) -> list[dict]:
    """The expert layer (``block``: 16 experts of the same shape) with its experts quantized (fp8 per
    channel, int4 in groups of 128; XLA's dequantise-then-ragged_dot) against bf16: ms per call at
    each token count."""
    from flax import nnx

    from jaxengine.models.moe import with_quantized_experts

    calls = {}
    for scheme, b in (("bf16", block), *((s, with_quantized_experts(block, s, jnp.bfloat16)) for s in ("fp8", "int4"))):
        graphdef, state = nnx.split(b)
        calls[scheme] = (jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x)[0]), state)
    rows = []
    for tokens in token_counts:
        x = jax.random.normal(jax.random.key(tokens), (tokens, block.cfg.hidden_size), jnp.bfloat16)
        row = {"tokens": tokens}
        for scheme, (fn, state) in calls.items():
            try:
                row[f"{scheme}_ms"] = round(timed(fn, state, x) * 1e3, 4)
            except Exception as error:      # noqa: BLE001 - record it, measure the rest
                row[f"{scheme}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------- quantized weights
def quantized(smoke: bool, copy_gbs: float, matmul_tflops: float, save_part=lambda result: None) -> dict:
    """Llama-3-8B's gate projection (4096 x 14336) with fp8 and int8 (per channel) and int4 (groups
    of 128) weights through XLA's dequantise-and-dot against bf16, and fp8 with the activations
    quantized too (per token, "fp8_w8a8": convert, dot, scale, the pattern XLA's GEMM rewriter
    turns into an FP8 cuBLAS GEMM), at decode batches and a prefill: ms, TFLOP/s and the weight
    bytes read per second; and whether XLA wrote the dequantised weight to memory (an HLO value
    of the whole weight's shape outside the dot) or ran an FP8 GEMM (an f8 custom call)."""
    import re

    from jaxengine.kernels.matmul.quantized import FP8_MAX, QuantizedWeight, pack_int4, quantize, xla_quantized_dense

    k, n = (256, 512) if smoke else (4096, 14336)
    w = np.random.default_rng(0).standard_normal((k, n), np.float32) * 0.02
    weights = {"bf16": jnp.asarray(w, jnp.bfloat16)}
    for fmt, group in (("fp8", k), ("int8", k), ("int4", 128)):
        values, scale, offset = quantize(w, fmt, group, axis=0)
        q = pack_int4(values, 0) if fmt == "int4" else values
        weights[fmt] = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale),
                                       None if offset is None else jnp.asarray(offset), 4 if fmt == "int4" else 8)
    weights["fp8_w8a8"] = weights["fp8"]

    def w8a8(x, w):
        sx = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32) / FP8_MAX
        xq = (x / sx).astype(jnp.float8_e4m3fn)
        out = jnp.dot(xq, w.q[0] if w.q.ndim == 3 else w.q, preferred_element_type=jnp.float32)
        return (out * sx * w.scale.reshape(1, -1)).astype(x.dtype)

    def matmul_of(name):
        if name == "bf16":
            return jax.jit(lambda x, w: x @ w)
        return jax.jit(w8a8 if name == "fp8_w8a8" else xla_quantized_dense)

    result = {"shape": [k, n], "rows": [], "hlo_writes_dequantized_weight": {}, "hlo_fp8_gemm": {}}
    for name, weight in weights.items():
        hlo = matmul_of(name).lower(jnp.ones((16, k), jnp.bfloat16), weight).compile().as_text()
        whole = re.compile(rf"= bf16\[{k},{n}\]")
        result["hlo_writes_dequantized_weight"][name] = name != "bf16" and bool(whole.search(hlo))
        result["hlo_fp8_gemm"][name] = bool(re.search(r"custom-call.*f8e4m3fn|f8e4m3fn.*custom-call", hlo))
    for tokens in ((1, 16) if smoke else (1, 16, 64, 256, 4096)):
        x = jax.random.normal(jax.random.key(tokens), (tokens, k), jnp.bfloat16)
        row = {"tokens": tokens}
        for name, weight in weights.items():
            t = timed(matmul_of(name), x, weight)
            stored = sum(a.nbytes for a in jax.tree.leaves(weight))
            row[name] = {"ms": round(t * 1e3, 4), "tflops": float(f"{2 * tokens * k * n / t / 1e12:.3g}"),
                         "weight_gbs": float(f"{stored / t / 1e9:.3g}"),
                         "fraction_of_copy_bw": float(f"{stored / t / 1e9 / copy_gbs:.3g}")}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    save_part(result)
    result["fp8_kv_attention"] = fp8_kv_attention(smoke, copy_gbs)
    print(json.dumps(result["fp8_kv_attention"]), flush=True)
    return result


def fp8_kv_attention(smoke: bool, copy_gbs: float) -> dict:
    """Decode attention (both Pallas kernels, Llama-3-8B heads, 256 rows x 2k context) over a bf16
    cache and over the same values in an FP8 cache: per kernel, ms, the cache bytes read per
    second, and how far the FP8 output is from the bf16 one."""
    from jaxengine.models.layers import to_fp8

    heads = (2, 4, 64) if smoke else (8, 4, 128)
    context, batch = (64, 8) if smoke else (2048, 256)
    q, k, v, md, kv_bytes = attention_batch([(context - 1, 1)] * batch, 16, *heads, jnp.bfloat16)
    k8, v8 = to_fp8(k, jnp.float32(0.01)), to_fp8(v, jnp.float32(0.01))
    if jax.devices()[0].platform == "cpu":
        interpret_mosaic()
    result = {}
    for kernel_name, attention in KERNELS.items():
        fn = jax.jit(lambda q, k, v, md, s, attention=attention: attention(q, k, v, md, scale=0.088 * s))
        out = {}
        for name, args, read, scale in (("bf16", (k, v), kv_bytes, 1.0), ("fp8", (k8, v8), kv_bytes // 2, 0.01)):
            try:
                t = timed(fn, q, *args, md, jnp.float32(scale))
                got = np.asarray(fn(q, *args, md, jnp.float32(scale)), np.float32) * scale
            except Exception as error:      # noqa: BLE001 - record it, measure the rest
                out[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                continue
            out[name] = {"ms": round(t * 1e3, 3), "cache_gbs": round(read / t / 1e9, 1),
                         "fraction_of_copy_bw": round(read / t / 1e9 / copy_gbs, 3)}
            out[f"{name}_out"] = got
        if "bf16_out" in out and "fp8_out" in out:
            out["fp8_max_abs_diff_vs_bf16"] = float(np.abs(out["fp8_out"] - out["bf16_out"]).max())
            out["fp8_speedup_vs_bf16"] = round(out["bf16"]["ms"] / out["fp8"]["ms"], 2)
        result[kernel_name] = {k: v for k, v in out.items() if not k.endswith("_out")}
    return result


def median_step_ms(step, caches, repeats: int = 5) -> tuple:
    """``step(caches) -> (caches, out)`` (the caches donated) run once to compile, then
    ``repeats`` times: -> (the caches, the median ms)."""
    caches, out = step(caches)
    out.block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        caches, out = step(caches)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
    return caches, round(statistics.median(times) * 1e3, 3)


def speculation(smoke: bool, copy_gbs: float, matmul_tflops: float, save_part=lambda result: None) -> dict:
    """What a speculative verify step costs on the 8B-shaped random model (bf16, the engine's
    attention): B rows at 1k tokens of context, each with 1 token (a decode step) or with 1 + k
    (an input token and k draft tokens, logits of every one), B = 1 and 32, k = 4: ms, and the
    ratio to the decode step. A draft pays when its rows accept more than ratio - 1 tokens per
    step on average. An EAGLE-3 head for the model (``models.eagle3``: one layer of its width, a
    32,000-token draft vocabulary) drafting for B rows of one token: the cost of each draft token
    it proposes, so a speculating step is about verify + k x that."""
    from flax import nnx

    from jaxengine.kernels.paged_attention.backend import select_attention
    from jaxengine.models.forward import make_forward
    from jaxengine.models.llama import LlamaForCausalLM, init_kv_caches

    cfg = llama3_8b(smoke)
    model = LlamaForCausalLM(cfg, jnp.bfloat16, select_attention("auto"), rngs=nnx.Rngs(0))
    state, forward = make_forward(model)
    block, context = 16, 64 if smoke else 1024
    pages = -(-(context + 8) // block)
    result = {"context": context, "rows": []}
    for batch in (1, 32):
        caches = init_kv_caches(cfg, 1 + batch * pages, block, jnp.bfloat16)
        row = {"batch": batch}
        for k in (0, 4):
            n = batch * (1 + k)
            rows = [(context, 1 + k, list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(batch)]
            md = AttentionMetadata.build(rows, block, num_tokens=n, max_blocks=pages, num_rows=batch)
            ids = jnp.zeros(n, jnp.int32)

            def step(caches, ids=ids, md=md, n=n):
                caches, logits = forward(state, caches, ids, md, jnp.arange(n))
                return caches, logits

            caches, row["decode_ms" if k == 0 else f"verify_k{k}_ms"] = median_step_ms(step, caches)
        row["verify_over_decode"] = round(row["verify_k4_ms"] / row["decode_ms"], 3)
        row["eagle3_head_step_ms"] = head_step_ms(cfg, batch, block, context, pages)
        row["eagle3_step_k4_over_decode"] = round((row["verify_k4_ms"] + 4 * row["eagle3_head_step_ms"])
                                                  / row["decode_ms"], 3)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        save_part(result)
    return result


def lora(smoke: bool, copy_gbs: float, matmul_tflops: float, save_part=lambda result: None) -> dict:
    """LoRA on the 8B-shaped random model (bf16, the engine's attention): one step with 8 slots of
    rank 16 on every target, the rows spread over 8 adapters (and over 1), against the same step
    with no row on an adapter (the base model's work; the grouping still rides along), at decode
    batch 256 (1k tokens of context) and a 2,048-token prefill: ms and the overhead.
    Whether XLA kept ``ragged_dot`` for the delta or rewrote it densely (in kernel.json)."""
    from flax import nnx

    from jaxengine.kernels.paged_attention.backend import select_attention
    from jaxengine.models.forward import make_forward
    from jaxengine.models.llama import LlamaForCausalLM, init_kv_caches
    from jaxengine.models.lora_weights import attach_lora, lora_rows

    cfg = llama3_8b(smoke)
    model = LlamaForCausalLM(cfg, jnp.bfloat16, select_attention("auto"), rngs=nnx.Rngs(0))
    attach_lora(model, 8, 16, jnp.bfloat16)
    for path, variable in nnx.to_flat_state(nnx.state(model)):        # random slots: every delta non-zero
        if len(path) > 1 and path[-2] == "lora":
            key = jax.random.PRNGKey(hash(path) % (1 << 31))
            variable[...] = (jax.random.normal(key, variable[...].shape, jnp.float32) * 0.01).astype(jnp.bfloat16)
    state, forward = make_forward(model)
    block, context = 16, 64 if smoke else 1024
    result = {"slots": 8, "rank": 16, "context": context, "rows": []}
    cases = [(256 if not smoke else 32, 1), (1, 256 if smoke else 2048)]      # (rows, tokens per row)
    for rows, per_row in cases:
        pages = -(-(context + per_row) // block)
        caches = init_kv_caches(cfg, 1 + rows * pages, block, jnp.bfloat16)
        n = rows * per_row
        seq = [(context if per_row == 1 else 0, per_row, list(range(1 + r * pages, 1 + (r + 1) * pages)))
               for r in range(rows)]
        md = AttentionMetadata.build(seq, block, num_tokens=n, max_blocks=pages, num_rows=rows)
        row = {"rows": rows, "tokens": n}
        for name, adapters in (("base", 0), ("1_adapter", 1), ("8_adapters", 8)):
            slots = np.repeat(np.arange(rows) % adapters if adapters else np.full(rows, -1), per_row).astype(np.int32)
            order, sizes, inverse = lora_rows(slots, 8, n)
            md_lora = dataclasses.replace(md, lora_order=jnp.asarray(order), lora_sizes=jnp.asarray(sizes),
                                          lora_inverse=jnp.asarray(inverse))
            ids = jnp.zeros(n, jnp.int32)

            def step(caches, md=md_lora, ids=ids):
                return forward(state, caches, ids, md, jnp.arange(min(n, 256)))

            if name == "base" and per_row == 1:
                hlo = forward.lower(state, caches, ids, md_lora, jnp.arange(min(n, 256))).compile().as_text()
                result["hlo_ragged_dot"] = "ragged" in hlo
            caches, row[f"{name}_ms"] = median_step_ms(step, caches)
        row["overhead_8"] = round(row["8_adapters_ms"] / row["base_ms"] - 1, 3)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        save_part(result)
    return result


def head_step_ms(cfg, batch: int, block: int, context: int, pages: int) -> float:
    """One drafting step of an EAGLE-3 head for ``cfg`` (its one layer of the model's width, a
    32,000-token draft vocabulary) over ``batch`` rows of one token."""
    import dataclasses

    from flax import nnx

    from jaxengine.kernels.paged_attention.backend import select_attention
    from jaxengine.models.eagle3 import Eagle3Config, Eagle3Head
    from jaxengine.models.llama import init_kv_caches
    from jaxengine.sample.sampler import first_argmax

    head_cfg = Eagle3Config(dataclasses.replace(cfg, num_layers=1), cfg.hidden_size, 32000,
                            (2, cfg.num_layers // 2, cfg.num_layers - 3))
    graphdef, state = nnx.split(Eagle3Head(head_cfg, jnp.bfloat16, select_attention("auto"), rngs=nnx.Rngs(1)))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, caches, ids, hidden, md):
        head = nnx.merge(graphdef, state)
        normed, hidden, caches = head(ids, hidden, caches, md)
        return caches, first_argmax(head.model_logits(normed)), hidden

    caches = init_kv_caches(head_cfg.layer, 1 + batch * pages, block, jnp.bfloat16)
    rows = [(context, 1, list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(batch)]
    md = AttentionMetadata.build(rows, block, num_tokens=batch, max_blocks=pages, num_rows=batch)
    ids, hidden = jnp.zeros(batch, jnp.int32), jnp.zeros((batch, cfg.hidden_size), jnp.bfloat16)
    caches, tokens, hidden = step(state, caches, ids, hidden, md)
    tokens.block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        caches, tokens, hidden = step(state, caches, tokens, hidden, md)
        tokens.block_until_ready()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


# ---------------------------------------------------------------- summary
TARGETS = [  # (label, file, key path, target text, passes)
    ("HBM copy bandwidth (GB/s)", "ceilings", ("copy_bandwidth_gbs",), "baseline", None),
    ("bf16 matmul (TFLOP/s)", "ceilings", ("bf16_matmul_tflops",), "baseline", None),
    ("decode attention (Triton kernel), fraction of copy bandwidth", "kernel", ("decode", "pallas_fraction_of_copy_bw"),
     ">= 0.70", lambda v: v >= 0.70),
    ("decode attention (Mosaic kernel), fraction of copy bandwidth", "kernel", ("decode", "mosaic_fraction_of_copy_bw"),
     ">= 0.70", lambda v: v >= 0.70),
    ("decode attention (Triton kernel) vs plain-jnp path (speed-up)", "kernel", ("decode", "pallas_speedup_vs_reference"),
     "> 1", lambda v: v > 1),
    ("decode: Mosaic kernel speed-up over Triton kernel", "kernel", ("decode", "mosaic_speedup_vs_pallas"), "-", None),
    ("decode: JAX's decode-only Pallas kernel, fraction of copy bandwidth", "kernel",
     ("decode", "jax_decode_fraction_of_copy_bw"), "yardstick", None),
    ("decode: Triton kernel's output matches the plain-jnp path", "kernel", ("decode", "pallas_matches"), "true",
     lambda v: v is True),
    ("mixed: Triton kernel's output matches the plain-jnp path", "kernel", ("mixed", "pallas_matches"), "true",
     lambda v: v is True),
    ("decode: Mosaic kernel's output matches the plain-jnp path", "kernel", ("decode", "mosaic_matches"), "true",
     lambda v: v is True),
    ("mixed: Mosaic kernel's output matches the plain-jnp path", "kernel", ("mixed", "mosaic_matches"), "true",
     lambda v: v is True),
    ("decode: Pallas KV write's output matches the XLA scatter", "kernel", ("decode", "kv_write_pallas_matches"),
     "true", lambda v: v is True),
    ("mixed: Pallas KV write's output matches the XLA scatter", "kernel", ("mixed", "kv_write_pallas_matches"),
     "true", lambda v: v is True),
    ("mixed batch attention, Triton kernel (ms)", "kernel", ("mixed", "pallas_ms"), "-", None),
    ("mixed batch attention, Mosaic kernel (ms)", "kernel", ("mixed", "mosaic_ms"), "-", None),
    ("KV write, XLA scatter, decode batch (ms)", "kernel", ("decode", "kv_write_xla_scatter_ms"), "-", None),
    ("KV write, Pallas kernel, decode batch (ms)", "kernel", ("decode", "kv_write_pallas_ms"), "-", None),
    ("KV write, XLA scatter, mixed batch (ms)", "kernel", ("mixed", "kv_write_xla_scatter_ms"), "-", None),
    ("KV write, Pallas kernel, mixed batch (ms)", "kernel", ("mixed", "kv_write_pallas_ms"), "-", None),
    ("engine's attention backend", "engine", ("attention_backend",), "-", None),
    ("engine's KV write", "engine", ("kv_write",), "-", None),
    ("engine's kernels after its start-up check", "engine", ("kernels_after_start_up_check",), "-", None),
    ("decode step at batch 256 / roofline floor", "engine", ("decode_vs_floor",), "<= 1.25", lambda v: v <= 1.25),
    ("offline output tok/s (1000 x 128/128)", "engine", ("output_tok_s",), ">= 15000", lambda v: v >= 15000),
    ("decode step, mesh of one / unsharded", "sharding", ("mesh of 1", "decode_vs_unsharded"), "<= 1.05",
     lambda v: v <= 1.05),
    ("prefill step, mesh of one / unsharded", "sharding", ("mesh of 1", "prefill_vs_unsharded"), "<= 1.05",
     lambda v: v <= 1.05),
    ("mesh of one: same tokens as unsharded", "sharding", ("same_tokens",), "true", lambda v: v is True),
    ("MoE layer: XLA keeps ragged_dot (no dense rewrite)", "kernel", ("moe", "hlo_keeps_ragged_dot"), "true",
     lambda v: v is True),
]


def mla(smoke: bool, copy_gbs: float, matmul_tflops: float, save_part=lambda result: None) -> dict:
    """DeepSeek-V3's latent attention in one layer at decode (bf16: 128 heads, latent 512 + rotary
    64, keys 128 + 64 and values 128 a head), 256 rows at 2k tokens of context (smoke: 8 at 64),
    absorbed through the kernel the engine picks for it (``select_attention("auto")`` where it
    serves a head of 576, else the plain-jnp path, as the engine does): ms, the latent cache's GB/s
    (bytes read / time) and its share of the copy bandwidth; its output against the decompressed
    form on the first 4 rows."""
    from jaxengine.kernels.paged_attention.backend import select_attention, serving_kernel
    from jaxengine.kernels.paged_attention.latent import absorbed_attention, decompressed_attention

    heads, rank, rotary, nope, value, block = 128, 512, 64, 128, 128, 16
    rows, context = (8, 64) if smoke else (256, 2048)
    pages = -(-context // block)
    keys = jax.random.split(jax.random.key(3), 5)
    cache = jax.random.normal(keys[0], (1 + rows * pages, block, 1, rank + rotary), jnp.bfloat16)
    q_nope = jax.random.normal(keys[1], (rows, heads, nope), jnp.bfloat16)
    q_rope = jax.random.normal(keys[2], (rows, heads, rotary), jnp.bfloat16)
    w_uk = (jax.random.normal(keys[3], (rank, heads, nope), jnp.float32) * rank ** -0.5).astype(jnp.bfloat16)
    w_uv = (jax.random.normal(keys[4], (rank, heads, value), jnp.float32) * rank ** -0.5).astype(jnp.bfloat16)
    md = AttentionMetadata.build([(context - 1, 1, list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(rows)],
                                 block, num_tokens=rows, max_blocks=pages, num_rows=rows)
    md = jax.tree.map(jnp.asarray, md)
    scale = (nope + rotary) ** -0.5
    kernel = serving_kernel(select_attention("auto"), jnp.zeros((rows, heads, rank + rotary), jnp.bfloat16), cache,
                            cache, md)
    absorbed = jax.jit(lambda *a: absorbed_attention(*a, scale=scale, attention_fn=kernel))
    t = timed(absorbed, q_nope, q_rope, cache, md, w_uk, w_uv)
    read = rows * context * (rank + rotary) * 2
    result = {"rows": rows, "context": context, "kernel": getattr(kernel, "__name__", str(kernel)),
              "ms": round(t * 1e3, 3), "cache_gbs": round(read / t / 1e9, 1),
              "fraction_of_copy_bw": round(read / t / 1e9 / copy_gbs, 3)}
    save_part(result)
    few = jax.tree.map(lambda a: a[:4], (q_nope, q_rope))
    md_few = AttentionMetadata.build([(context - 1, 1, list(range(1 + r * pages, 1 + (r + 1) * pages)))
                                      for r in range(4)], block, num_tokens=4, max_blocks=pages, num_rows=4)
    md_few = jax.tree.map(jnp.asarray, md_few)
    want = decompressed_attention(*few, cache, md_few, w_uk, w_uv, scale=scale).astype(jnp.float32)
    got = absorbed(*few, cache, md_few, w_uk, w_uv).astype(jnp.float32)
    result["max_abs_diff_vs_decompressed"] = float(jnp.abs(got - want).max())
    result["max_abs_decompressed"] = float(jnp.abs(want).max())
    print(json.dumps(result), flush=True)
    return result


def hybrid(smoke: bool, copy_gbs: float, matmul_tflops: float, save_part=lambda result: None) -> dict:
    """The recurrent layers of the hybrid models at published shapes (bf16 weights, float32 states):
    a Gated DeltaNet layer of Qwen3.5-27B's (hidden 5120; 16 key and 48 value heads of 128) and a
    Mamba-2 layer of Nemotron-H-8B's (hidden 4096; 128 heads of 64, state 128, 8 groups), each in
    both forms (``recurrent_form``: tokens, one after another; chunked, segments of a row's tokens,
    a decode step's rows at once): a decode step of 64 rows (smoke: 4) and one 512-token prompt
    chunk (smoke: 16). ms, and at decode the states' GB/s (each row's state read and written) and
    its share of the copy bandwidth: which form ``auto`` should pick on a GPU."""
    from flax import nnx

    from jaxengine.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
    from jaxengine.models.mamba2 import Mamba2, Mamba2Shape

    layers = {"Gated DeltaNet": (GatedDeltaNet, GatedDeltaNetShape(256, 2, 4, 32, 32) if smoke else
                                 GatedDeltaNetShape(5120, 16, 48, 128, 128)),
              "Mamba-2": (Mamba2, Mamba2Shape(256, 8, 16, 16, 2) if smoke else Mamba2Shape(4096, 128, 64, 128, 8))}
    result = {"shape": "tiny" if smoke else "Qwen3.5-27B / Nemotron-H-8B", "rows": []}
    for layer_name, (cls, shape) in layers.items():
        layer = cls(shape, jnp.bfloat16, rngs=nnx.Rngs(0))
        conv_shape, state_shape = shape.state_shapes()
        for form in ("tokens", "chunked"):
            layer.recurrent_form = form
            graphdef, params = nnx.split(layer)
            step = jax.jit(lambda params, x, rows, conv, state, one, valid, graphdef=graphdef: nnx.merge(
                graphdef, params)(x, rows, conv, state, one_token_rows=one, num_valid=valid))
            for name, rows, tokens in (("decode", 4 if smoke else 64, None), ("prefill", 1, 16 if smoke else 512)):
                t_count = rows if tokens is None else tokens
                x = jax.random.normal(jax.random.key(0), (t_count, shape.hidden_size), jnp.bfloat16)
                token_rows = jnp.arange(t_count, dtype=jnp.int32) if tokens is None else jnp.zeros(t_count, jnp.int32)
                conv = jnp.zeros((rows, *conv_shape), jnp.float32)
                state = jnp.zeros((rows, *state_shape), jnp.float32)
                one_token_rows = jnp.asarray(tokens is None)
                t = timed(step, params, x, token_rows, conv, state, one_token_rows, t_count)
                row = {"layer": layer_name, "form": form, "step": name, "rows": rows, "tokens": t_count,
                       "ms": round(t * 1e3, 3)}
                if tokens is None:
                    moved = 2 * rows * int(np.prod(state_shape)) * 4
                    row["state_gbs"] = round(moved / t / 1e9, 1)
                    row["fraction_of_copy_bw"] = round(moved / t / 1e9 / copy_gbs, 3)
                result["rows"].append(row)
                save_part(result)
    print(json.dumps(result), flush=True)
    return result


def summary(out: Path) -> None:
    """All results in one JSON and a short table (printed last)."""
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in ("ceilings", "kernel", "engine", "sharding")
               if (out / f"{name}.json").exists()}
    lines = ["| check | value | target | met |", "|---|---|---|---|"]
    for label, name, path, target, passes in TARGETS:
        value = results.get(name)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        met = "-" if passes is None or value is None else ("yes" if passes(value) else "NO")
        lines.append(f"| {label} | {'missing' if value is None else value} | {target} | {met} |")
    for key, label in (("decode_sweep", "Triton"), ("decode_sweep_mosaic", "Mosaic")):
        best = next((r for r in results.get("kernel", {}).get(key, []) if r.get("matches")), None)
        if best:                                    # what the TUNED table should say for this layout
            sizes = ", ".join(f"{k}={v}" for k, v in best["sizes"].items())
            lines.append(f"| best {label} sizes, decode (ms) | {best['ms']} ({sizes}) | - | - |")
    quantized = results.get("kernel", {}).get("quantized", {})
    for row in quantized.get("rows", []):
        lines.append(f"| 8B gate projection, {row['tokens']} tokens: ms bf16 / fp8 / fp8 w8a8 / int8 / int4 | "
                     f"{row['bf16']['ms']} / {row['fp8']['ms']} / {row['fp8_w8a8']['ms']} / {row['int8']['ms']} / "
                     f"{row['int4']['ms']} | - | - |")
    if quantized.get("hlo_fp8_gemm"):
        lines.append(f"| FP8 GEMM in the HLO (fp8 / fp8 w8a8) | {quantized['hlo_fp8_gemm'].get('fp8')} / "
                     f"{quantized['hlo_fp8_gemm'].get('fp8_w8a8')} | - | - |")
    for kernel_name, kv in quantized.get("fp8_kv_attention", {}).items():
        if "fp8" in kv and "bf16" in kv:
            lines.append(f"| decode attention ({kernel_name}), FP8 KV vs bf16: ms, cache GB/s | {kv['fp8']['ms']} vs "
                         f"{kv['bf16']['ms']}, {kv['fp8']['cache_gbs']} vs {kv['bf16']['cache_gbs']} | - | - |")
    for row in results.get("kernel", {}).get("speculation", {}).get("rows", []):
        lines.append(f"| 8B verify step, batch {row['batch']}: ms decode / 4 drafts a row (ratio) | {row['decode_ms']} / "
                     f"{row.get('verify_k4_ms')} ({row.get('verify_over_decode')}) | - | - |")
        lines.append(f"| EAGLE-3 head's drafting step, batch {row['batch']}: ms (k = 4 step over decode) | "
                     f"{row.get('eagle3_head_step_ms')} ({row.get('eagle3_step_k4_over_decode')}) | - | - |")
    for row in results.get("kernel", {}).get("lora", {}).get("rows", []):
        lines.append(f"| 8B step with LoRA, {row['rows']} rows / {row['tokens']} tokens: ms base / 1 / 8 adapters "
                     f"(overhead at 8) | {row['base_ms']} / {row['1_adapter_ms']} / {row['8_adapters_ms']} "
                     f"({row['overhead_8']}) | <= 0.15 | {'yes' if row['overhead_8'] <= 0.15 else 'NO'} |")
    if mla_row := results.get("kernel", {}).get("mla"):
        lines.append(f"| DeepSeek-V3 latent attention, decode {mla_row['rows']} x {mla_row['context']}: ms, cache GB/s "
                     f"(share of copy), max diff vs decompressed | {mla_row['ms']}, {mla_row['cache_gbs']} "
                     f"({mla_row['fraction_of_copy_bw']}), {mla_row.get('max_abs_diff_vs_decompressed')} | - | - |")
    for row in results.get("kernel", {}).get("hybrid", {}).get("rows", []):
        lines.append(f"| {row['layer']} layer ({row['form']}), {row['step']} {row['rows']} rows / {row['tokens']} "
                     f"tokens: ms, state GB/s (share of copy) | {row['ms']}, {row.get('state_gbs', '-')} "
                     f"({row.get('fraction_of_copy_bw', '-')}) | - | - |")
    for row in results.get("kernel", {}).get("moe", {}).get("quantized_experts", []):
        lines.append(f"| MoE layer, {row['tokens']} tokens, experts bf16 / fp8 / int4 (ms) | {row.get('bf16_ms')} / "
                     f"{row.get('fp8_ms')} / {row.get('int4_ms')} | - | - |")
    for row in results.get("kernel", {}).get("moe", {}).get("rows", []):
        lines.append(f"| MoE layer, {row['tokens']} tokens: ms, TFLOP/s, weight GB/s (share of copy) | {row['ms']}, "
                     f"{row['tflops']}, {row['weight_read_gbs']} ({row['fraction_of_copy_bw']}) | - | - |")
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ceilings", "kernel", "engine", "moe", "quantized", "speculation", "lora",
                                         "mla", "hybrid", "summary"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a dry run, also on the CPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "summary":
        return summary(args.out)
    if args.what in ("moe", "quantized", "speculation", "lora", "mla", "hybrid"):      # into kernel.json: the device tool brings back 8 files at most
        ceil = json.loads((args.out / "ceilings.json").read_text())
        kernel_file = args.out / "kernel.json"
        merged = json.loads(kernel_file.read_text()) if kernel_file.exists() else {}

        def save_part(result: dict) -> None:          # also midway: a part cut by its time limit keeps its rows
            merged[args.what] = result
            kernel_file.write_text(json.dumps(merged, indent=1))

        part = {"moe": moe, "quantized": quantized, "speculation": speculation, "lora": lora, "mla": mla,
                "hybrid": hybrid}[args.what]
        save_part(part(args.smoke, ceil["copy_bandwidth_gbs"], ceil["bf16_matmul_tflops"], save_part))
        return None
    info = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    path = args.out / f"{args.what}.json"

    def save(part: dict) -> None:
        path.write_text(json.dumps({**info, **part}, indent=1))

    if args.what == "ceilings":
        result = ceilings(args.smoke)
    else:
        ceil = json.loads((args.out / "ceilings.json").read_text())
        result = (kernel(args.smoke, ceil["copy_bandwidth_gbs"], save) if args.what == "kernel"
                  else engine(args.smoke, ceil, faster_kernel(args.out), faster_kv_write(args.out),
                              use_best_sizes(args.out, *ENGINE_LAYOUT)))
    save(result)
    result = {**info, **result}
    print(json.dumps(result)[:2000], flush=True)


if __name__ == "__main__":
    main()
