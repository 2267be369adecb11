"""The draft_model and eagle3 proposers' cost per step on the CPU: the default model
(SmolLM2-135M), or a random EAGLE-3 head of its width (one layer, a 32,000-token draft
vocabulary, the model's embedding), drafting for a random-weight model of its family twice as
deep (60 layers), against that model without speculation, and the parts of a speculative step
against what they should cost.

    python scripts/bench_draft_model.py [--ks 2,4] [--methods draft_model,eagle3] [--tokens 48] [--json PATH]

With random target weights the draft's tokens are almost never the target's, so every draft is
rejected: what this measures is the mechanism's price per step (a verify step of 1 + k tokens,
the draft model over them, and k draft decode steps), which acceptance on a real pair pays back.
Every draft goes (the gate's choice is overridden): the point is the cost. Same tokens as the
model without speculation (checked). Steps of one configuration after another, one request at a
time; the median step of each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine import LLM, SamplingParams
from jaxengine.default_model import default_model_path
from jaxengine.engine import Engine
from jaxengine.kernels.paged_attention.backend import select_attention
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.models.weights import load_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43], [100, 200, 300, 400, 500, 600]]
OPTIONS = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, compile_mode="eager",
               skip_tokenizer_init=True)


def deep_target():
    """(module, config): the default model's shape with twice its layers, random weights (f32)."""
    _, cfg = load_model(default_model_path(), jnp.float32)
    cfg = dataclasses.replace(cfg, num_layers=2 * cfg.num_layers, quantization=())
    return LlamaForCausalLM(cfg, jnp.float32, select_attention("auto"), rngs=nnx.Rngs(0)), cfg


def random_eagle3_head(folder: Path, cfg) -> Path:
    """An EAGLE-3 head checkpoint for ``cfg``'s model: random weights, no embedding of its own."""
    from safetensors.numpy import save_file

    d, h, f, n, kv = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads
    rng, vocab = np.random.default_rng(0), 32000

    def w(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    a, m = "midlayer.self_attn.", "midlayer."
    tensors = {"fc.weight": w(d, 3 * d), a + "q_proj.weight": w(n * h, 2 * d), a + "k_proj.weight": w(kv * h, 2 * d),
               a + "v_proj.weight": w(kv * h, 2 * d), a + "o_proj.weight": w(d, n * h),
               m + "mlp.gate_proj.weight": w(f, d), m + "mlp.up_proj.weight": w(f, d), m + "mlp.down_proj.weight": w(d, f),
               "lm_head.weight": w(vocab, d), "d2t": np.zeros(vocab, np.int64)}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[name + ".weight"] = np.ones(d, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=d, intermediate_size=f,
                  num_attention_heads=n, num_key_value_heads=kv, head_dim=h, num_hidden_layers=1,
                  vocab_size=cfg.vocab_size, draft_vocab_size=vocab, rms_norm_eps=cfg.rms_norm_eps,
                  rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def timed_steps(llm: LLM, tokens: int) -> tuple[list[float], list[list[int]]]:
    """Each engine step's seconds over the prompts (one at a time), and the outputs."""
    seconds, record = [], Engine._record

    def timing(self, launched, output):
        record(self, launched, output)
        if not launched.out.num_prefill_tokens:
            seconds.append(self.last_trace.step_s)

    Engine._record = timing
    try:
        outs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    finally:
        Engine._record = record
    return seconds, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,4")
    parser.add_argument("--methods", default="draft_model,eagle3")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json")
    args = parser.parse_args()
    draft_path = str(default_model_path())
    module, cfg = deep_target()
    plain = LLM(module, model_config=cfg, **OPTIONS)
    draft_alone = LLM(draft_path, **OPTIONS)
    plain_steps, want = timed_steps(plain, args.tokens)
    draft_steps, _ = timed_steps(draft_alone, args.tokens)
    result = {"target_layers": cfg.num_layers, "plain_decode_step_ms": round(1e3 * statistics.median(plain_steps), 2),
              "draft_decode_step_ms": round(1e3 * statistics.median(draft_steps), 2), "configs": []}
    print(json.dumps(result), flush=True)
    head_path = str(random_eagle3_head(Path(tempfile.mkdtemp()), cfg))
    for method, k in [(m, int(x)) for m in args.methods.split(",") for x in args.ks.split(",")]:
        module, _ = deep_target()
        llm = LLM(module, model_config=cfg, speculative_config={
            "method": method, "model": draft_path if method == "draft_model" else head_path,
            "num_speculative_tokens": k}, **OPTIONS)
        gate = llm.engine.scheduler.gate
        gate.plan = lambda tokens, rows, proposals, limit=None, gate=gate: [min(n, gate.k) for n, _ in proposals]
        drafter = llm.engine.runner.drafter
        start = time.perf_counter()
        steps, got = timed_steps(llm, args.tokens)
        elapsed = time.perf_counter() - start
        row = {"method": method, "k": k, "same_tokens": got == want, "step_ms": round(1e3 * statistics.median(steps), 2),
               "propose_ms_per_step": round(1e3 * drafter.propose_s / max(drafter.num_proposals, 1), 2),
               "steps": len(steps), "seconds": round(elapsed, 2),
               "expected_propose_ms": round(k * result["draft_decode_step_ms"], 2)}
        row["step_over_plain"] = round(row["step_ms"] / result["plain_decode_step_ms"], 2)
        print(json.dumps(row), flush=True)
        result["configs"].append(row)
        del llm, module
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
