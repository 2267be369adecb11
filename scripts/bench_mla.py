"""Multi-head latent attention: what a token costs the KV cache, and the decode step in both forms.

    python scripts/bench_mla.py [--rows 32] [--context 512] [--repeats 15] [--out bench_results/mla.json]

1. KV bytes per token, all layers, bf16, for DeepSeek-V3's shape (transformers' ``DeepseekV3Config``
   defaults: 61 layers, 128 heads, latent 512 + rotary 64, keys 192 and values 128 per head): the
   latent cache against the per-head keys and values a decompressed cache would hold, and against
   grouped-query caches (2.25 groups is the MLA paper's equivalence on paper; 8 KV heads of 128 is
   the common GQA choice). Beside each, the pool the engine sizes for 1 GiB of device memory
   (``EngineArgs.create_engine_config``, blocks of 16): measured pool sizes, not arithmetic.
2. The decode step of a small random-weight DeepSeek-V3-shaped model on this CPU (f32; 4 layers,
   the first dense, hidden 512, 16 heads, latent 128 + rotary 32, 8 experts of 256, top 2):
   ``--rows`` rows at ``--context`` tokens, absorbed against decompressed attention, the two
   steps interleaved, medians of ``--repeats``; both forms' logits compared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

GIB = 1 << 30


def kv_costs() -> dict:
    from transformers import DeepseekV3Config

    from jaxengine import EngineArgs
    from jaxengine.models.config import ModelConfig

    mla = ModelConfig.from_hf(DeepseekV3Config())
    heads = mla.num_heads
    layouts = {
        "latent (MLA)": mla,
        # the same bytes as per-head K of 192 and V of 128: two arrays of 160 a head
        "decompressed K/V (MHA)": mla.replace(kv_lora_rank=0, num_kv_heads=heads, head_dim=(192 + 128) // 2),
        "GQA, 8 KV heads of 128": mla.replace(kv_lora_rank=0, num_kv_heads=8, head_dim=128),
    }
    args = EngineArgs(kv_cache_memory_bytes=GIB, block_size=16)
    out = {"model": f"DeepSeek-V3 shape: {mla.num_layers} layers, {heads} heads, latent {mla.kv_lora_rank} + rotary "
                    f"{mla.head_dim}", "rows": []}
    for name, cfg in layouts.items():
        per_block = args.kv_bytes_per_block(cfg, jnp.bfloat16)
        blocks = args.create_engine_config(cfg, jnp.bfloat16).cache.num_gpu_blocks
        out["rows"].append({"layout": name, "kv_bytes_per_token": per_block // 16,
                            "tokens_in_1_gib": blocks * 16})
    latent = out["rows"][0]["kv_bytes_per_token"]
    out["gqa_2.25_groups_bytes_per_token"] = int(mla.num_layers * 2 * 2.25 * 128 * 2)   # on paper, = latent
    for row in out["rows"]:
        row["times_latent"] = round(row["kv_bytes_per_token"] / latent, 2)
    return out


def small_model(form: str):
    from flax import nnx

    from jaxengine.models.config import ModelConfig
    from jaxengine.models.llama import LlamaForCausalLM

    cfg = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                      num_layers=4, num_heads=16, num_kv_heads=16, head_dim=32, kv_lora_rank=128,
                      qk_nope_head_dim=64, v_head_dim=64, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=256, shared_expert_intermediate_size=256, shared_expert_gated=False,
                      scoring="sigmoid", score_correction_bias=True, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, dense_layers=(0,))
    return cfg, LlamaForCausalLM(cfg, jnp.float32, latent_attention_form=form, rngs=nnx.Rngs(0))


def decode_steps(rows: int, context: int, repeats: int) -> dict:
    from jaxengine.kernels.paged_attention import AttentionMetadata
    from jaxengine.models.forward import make_forward
    from jaxengine.models.llama import init_kv_caches

    block = 16
    pages = -(-(context + 1) // block)
    md = AttentionMetadata.build([(context, 1, list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(rows)],
                                 block, num_tokens=rows, max_blocks=pages, num_rows=rows)
    ids = jnp.arange(rows, dtype=jnp.int32) % 4096
    steps, caches, logits = {}, {}, {}
    for form in ("absorbed", "decompressed"):
        cfg, model = small_model(form)
        state, forward = make_forward(model)
        cache = init_kv_caches(cfg, 1 + rows * pages, block, jnp.float32)
        cache = tuple(jax.random.normal(jax.random.PRNGKey(1), c.shape, c.dtype) for c in cache)   # a full context
        steps[form] = lambda c, state=state, forward=forward: forward(state, c, ids, md, jnp.arange(rows))
        caches[form], logits[form] = steps[form](cache)                # compiles
    times = {form: [] for form in steps}
    for _ in range(repeats):                                            # interleaved
        for form, step in steps.items():
            start = time.perf_counter()
            caches[form], out = step(caches[form])
            out.block_until_ready()
            times[form].append(time.perf_counter() - start)
    ms = {form: round(statistics.median(t) * 1e3, 2) for form, t in times.items()}
    return {"rows": rows, "context": context, "absorbed_ms": ms["absorbed"], "decompressed_ms": ms["decompressed"],
            "decompressed_over_absorbed": round(ms["decompressed"] / ms["absorbed"], 2),
            "max_abs_logit_diff": float(jnp.abs(logits["absorbed"] - logits["decompressed"]).max()),
            "device": str(jax.devices()[0]), "cpu_cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench_results/mla.json")
    args = parser.parse_args()
    result = {"kv_cache": kv_costs(), "decode_step": decode_steps(args.rows, args.context, args.repeats)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
