"""The default model with its weights kept quantized against f32: resident weight bytes, decode
step time at batch 1 and 64 (the schemes' steps run in turns), and quality (mean |logit difference| and greedy agreement over 256
positions against the f32 model, same tokens).

    python scripts/bench_quantization.py [--repeats 7] [--json PATH]

Schemes: ``f32`` (the GGUF dequantised, what every earlier figure ran), ``gguf`` (the file's
Q4_1 projections kept as int4 with their scales and minimums, its Q8_0 embedding as int8: the
default), ``fp8`` / ``int8`` / ``int4``: the f32 weights quantized while loading
(``--quantization``), and ``gguf + fp8 KV``: the default with ``--kv-cache-dtype fp8``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.default_model import default_model_path
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import make_forward
from jaxengine.models.gguf import load_gguf, read_gguf
from jaxengine.models.hf_tensors import ArraySource
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.quantization import QuantizingSource, online_plan
from jaxengine.models.weights import build_model
from jaxengine.tokenizer import load_tokenizer

BLOCK = 16
CONTEXT = 256                 # each decode row's context
POSITIONS = 256               # quality: logits compared at this many positions
PROMPT = "Explain in a few paragraphs how a refrigerator keeps food cold."


FP8 = jnp.dtype(jnp.float8_e4m3fn)


def models(path):
    """scheme -> (the default model loaded that way, its KV cache dtype)."""
    f32, _ = load_gguf(path, keep_quantized=False)
    kept, _ = load_gguf(path)
    cfg, tensors = read_gguf(path)
    out = {"f32": (f32, jnp.float32), "gguf": (kept, jnp.float32)}
    for scheme in ("fp8", "int8", "int4"):
        planned = cfg.replace(quantization=online_plan(cfg, scheme))
        out[scheme] = (build_model(planned, QuantizingSource(ArraySource(tensors), planned)), jnp.float32)
    out["gguf + fp8 KV"] = (kept, FP8)
    return out


def resident_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def decode_step(model, batch: int, kv_dtype=jnp.float32):
    """One decode step of ``batch`` rows, each at CONTEXT tokens, logits of every row: a call
    that runs it (compiled and run once here)."""
    cfg = model.config
    pages = -(-(CONTEXT + 1) // BLOCK)
    rows = [(CONTEXT, 1, list(range(1 + r * pages, 1 + (r + 1) * pages))) for r in range(batch)]
    md = AttentionMetadata.build(rows, BLOCK, num_tokens=batch, max_blocks=pages, num_rows=batch)
    state, forward = make_forward(model)
    caches = init_kv_caches(cfg, 1 + batch * pages, BLOCK, kv_dtype)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, batch), jnp.int32)
    index = jnp.arange(batch)
    held = {"caches": caches}

    def step():
        held["caches"], logits = forward(state, held["caches"], ids, md, index)
        logits.block_until_ready()
    step()
    return step


def decode_ms_in_turns(loaded: dict, batch: int, repeats: int) -> dict[str, float]:
    """Median ms of each scheme's decode step, the schemes' steps run in turns (so a machine
    whose speed drifts moves them all alike)."""
    steps = {name: decode_step(model, batch, kv_dtype) for name, (model, kv_dtype) in loaded.items()}
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


CHUNK = 64
_FORWARDS = {}


def all_logits(model, ids: list[int], kv_dtype=jnp.float32) -> np.ndarray:
    """Logits at every position of ``ids`` (at most POSITIONS), prefilled in chunks of 64 through
    the paged cache, the last one padded: one compiled shape per model."""
    if id(model) not in _FORWARDS:
        _FORWARDS[id(model)] = make_forward(model)
    state, forward = _FORWARDS[id(model)]
    pages = POSITIONS // BLOCK + 1
    caches = init_kv_caches(model.config, pages + 1, BLOCK, kv_dtype)
    table = list(range(1, pages + 1))
    out = []
    for start in range(0, len(ids), CHUNK):
        n = min(CHUNK, len(ids) - start)
        md = AttentionMetadata.build([(start, n, table)], BLOCK, num_tokens=CHUNK, max_blocks=pages)
        chunk = jnp.asarray(np.pad(ids[start:start + n], (0, CHUNK - n)), jnp.int32)
        caches, logits = forward(state, caches, chunk, md, jnp.minimum(jnp.arange(CHUNK), n - 1))
        out.append(np.asarray(logits)[:n])
    return np.concatenate(out)


def greedy_sequence(model, prompt_ids: list[int]) -> list[int]:
    """The prompt followed by the model's greedy continuation, POSITIONS tokens in all
    (recomputed from the start each token: simple, and short enough here)."""
    ids = list(prompt_ids)
    while len(ids) < POSITIONS:
        ids.append(int(all_logits(model, ids)[-1].argmax()))
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    path = default_model_path()
    loaded = models(path)
    tokenizer = load_tokenizer(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    sequence = greedy_sequence(loaded["f32"][0], prompt)
    reference = all_logits(loaded["f32"][0], sequence)
    results = {}
    batch1, batch64 = decode_ms_in_turns(loaded, 1, args.repeats), decode_ms_in_turns(loaded, 64, args.repeats)
    for name, (model, kv_dtype) in loaded.items():
        logits = all_logits(model, sequence, kv_dtype)
        cfg = model.config
        results[name] = dict(
            weight_bytes=resident_bytes(model),
            kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(kv_dtype).itemsize,
            decode_ms_batch1=batch1[name], decode_ms_batch64=batch64[name],
            mean_abs_logit_diff=float(np.abs(logits - reference).mean()),
            greedy_agreement=float((logits.argmax(-1) == reference.argmax(-1)).mean()))
    base = results["f32"]
    print(f"default model, {POSITIONS} positions of {len(prompt)} prompt + greedy f32 tokens; decode rows at "
          f"{CONTEXT} tokens of context; {jax.device_count()} {jax.default_backend()} device(s)")
    print("| scheme | weight MB | of f32 | KV bytes / token | decode ms, batch 1 | speed vs f32 | decode ms, batch 64 | speed vs f32 "
          "| mean abs Δ logit | greedy agreement |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['weight_bytes'] / 1e6:.1f} | {r['weight_bytes'] / base['weight_bytes']:.1%} | "
              f"{r['kv_bytes_per_token']} | "
              f"{r['decode_ms_batch1']:.1f} | {base['decode_ms_batch1'] / r['decode_ms_batch1']:.2f}× | "
              f"{r['decode_ms_batch64']:.1f} | {base['decode_ms_batch64'] / r['decode_ms_batch64']:.2f}× | "
              f"{r['mean_abs_logit_diff']:.3f} | {r['greedy_agreement']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
