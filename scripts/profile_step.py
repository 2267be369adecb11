"""Where one step of the default model goes on this machine: a decode step at batch 64
(contexts 300-700) and a 512-token prefill step, timed whole and with one part taken out at a
time (attention reads, KV writes, logits, sampler), plus the projection and MLP matmuls alone,
each beside its memory-traffic floor.

    python scripts/profile_step.py [--repeats 7] [--json PATH]

Each variant is the same jitted step (``models.forward.make_forward``) with one part replaced by
a stand-in of the same shapes, so a part's time is the difference between two compiled steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.costmodel.floors import matmul_gflops
from jaxengine.default_model import default_model_path
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import make_forward
from jaxengine.models.layers import attention_modules
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.weights import load_model
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sample.sampler import sample

BLOCK = 16


def decode_rows(rng, batch: int = 64, low: int = 300, high: int = 700):
    """``batch`` decode rows with contexts uniform in [low, high], each on its own pages."""
    contexts = rng.integers(low, high + 1, batch)
    rows, next_block = [], 1
    for c in contexts:
        n = -(-(int(c) + 1) // BLOCK)
        rows.append((int(c), 1, list(range(next_block, next_block + n))))
        next_block += n
    return rows, next_block


def prefill_rows(num_tokens: int = 512, prompt: int = 128):
    """Whole prompts of ``prompt`` tokens filling a ``num_tokens`` step."""
    rows, next_block = [], 1
    for _ in range(num_tokens // prompt):
        n = -(-prompt // BLOCK)
        rows.append((0, prompt, list(range(next_block, next_block + n))))
        next_block += n
    return rows, next_block


def greedy_metadata(num_rows: int, vocab: int) -> SamplingMetadata:
    """Every row greedy, no penalty, no logprobs, no grammar: the common decode."""
    f = lambda value, shape=(num_rows,), dtype=jnp.float32: jnp.full(shape, value, dtype)   # noqa: E731
    return SamplingMetadata(
        temperature=f(0.0), top_p=f(1.0), top_k=f(0, dtype=jnp.int32), min_p=f(0.0),
        seed=f(0, (num_rows, 2), jnp.uint32), sample_index=f(0, dtype=jnp.int32), step=f(0, dtype=jnp.int32),
        want_logprobs=f(False, dtype=bool), presence_penalty=f(0.0), frequency_penalty=f(0.0),
        repetition_penalty=f(1.0), history=f(0, (num_rows, 1), jnp.int32), num_prompt=f(0, dtype=jnp.int32),
        num_history=f(0, dtype=jnp.int32), bias_ids=f(0, (num_rows, 1), jnp.int32),
        bias_values=f(0.0, (num_rows, 1)), logprobs_temperature=f(1.0),
        token_bitmask=f(-1, (num_rows, -(-vocab // 32)), jnp.int32), constrained=f(False, dtype=bool))


def timed(fn, repeats: int) -> float:
    fn()                                                    # compile and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_variants():
    """name -> (attention_fn or None to keep, kv_write_fn or None, head)."""
    def no_attention(q, k_cache, v_cache, md, **kw):
        return q

    def no_write(k_cache, v_cache, k, v, slots):
        return k_cache, v_cache

    def hidden_head(m, hidden, idx, *extra):
        return hidden[idx]

    def logits_head(m, hidden, idx, *extra):
        return m.compute_logits(hidden[idx])

    def sample_head(m, hidden, idx, smd):
        return sample(m.compute_logits(hidden[idx]), smd, 0).token_ids

    return {
        "whole step (greedy sampler)": (None, None, sample_head),
        "without the sampler": (None, None, logits_head),
        "without the sampler and logits": (None, None, hidden_head),
        "... and without attention reads": (no_attention, None, hidden_head),
        "... and without KV writes": (no_attention, no_write, hidden_head),
    }


def run_variants(model_path, rows, num_blocks, num_tokens, num_rows, repeats) -> dict[str, float]:
    results = {}
    md = AttentionMetadata.build(rows, BLOCK, num_tokens=num_tokens, max_blocks=max(len(r[2]) for r in rows) + 1,
                                 num_rows=num_rows)
    last = np.cumsum([n for _, n, _ in rows]) - 1
    logits_indices = jnp.asarray(np.pad(last, (0, num_rows - len(rows))))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 1000, num_tokens), jnp.int32)
    for name, (attention_fn, write_fn, head) in step_variants().items():
        model, cfg = load_model(model_path)
        for module in attention_modules(model):
            if attention_fn is not None:
                module.attention_fn = attention_fn
            if write_fn is not None:
                module.kv_write_fn = write_fn
        state, forward = make_forward(model, head=head)
        caches = [init_kv_caches(cfg, num_blocks, BLOCK)]
        extra = (greedy_metadata(num_rows, cfg.vocab_size),) if head.__name__ == "sample_head" else ()

        def call():
            caches[0], out = forward(state, caches[0], ids, md, logits_indices, *extra)
            jax.block_until_ready(out)

        results[name] = timed(call, repeats)
        print(f"  {name}: {results[name] * 1e3:.1f} ms", flush=True)
    return results


def matmul_time(cfg, num_tokens: int, repeats: int) -> float:
    """The 30 layers' projection and MLP matmuls alone at ``num_tokens`` tokens."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o = cfg.num_heads * cfg.head_dim
    key = jax.random.key(0)
    w = [jax.random.normal(key, (cfg.num_layers, *s), jnp.float32) for s in ((d, qkv), (o, d), (d, 2 * f), (f, d))]
    x = jax.random.normal(key, (num_tokens, d), jnp.float32)

    @jax.jit
    def layers(x, w):
        def body(x, ws):
            a, b, c, e = ws
            x = x + (x @ a)[:, :o] @ b
            gu = x @ c
            return x + (gu[:, :f] * gu[:, f:]) @ e, None
        return jax.lax.scan(body, x, w)[0]

    return timed(lambda: layers(x, w).block_until_ready(), repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    path = default_model_path(progress=False)
    _, cfg = load_model(path)
    peak = matmul_gflops() * 1e9
    report = {"matmul_gflops": peak / 1e9}
    rng = np.random.default_rng(0)
    for kind, (rows, blocks), num_tokens, num_rows in (
            ("decode, batch 64, contexts 300-700", decode_rows(rng), 64, 64),
            ("prefill, 4 prompts of 128 tokens", prefill_rows(), 512, 8)):
        print(kind, flush=True)
        times = run_variants(path, rows, blocks + 1, num_tokens, num_rows, args.repeats)
        times["projection and MLP matmuls alone"] = matmul_time(cfg, num_tokens, args.repeats)
        print(f"  projection and MLP matmuls alone: {times['projection and MLP matmuls alone'] * 1e3:.1f} ms")
        context = sum(c + n for c, n, _ in rows)
        report[kind] = {"ms": {k: v * 1e3 for k, v in times.items()}, "tokens": num_tokens, "rows": len(rows),
                        "context_tokens": context}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
