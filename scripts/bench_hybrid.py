"""Hybrid models (Qwen3.5: Gated DeltaNet layers with a recurrent state among full-attention
layers; Nemotron-H: Mamba-2 and attention blocks, each followed by an MLP block) against a
full-attention model of the same size (Qwen3), tiny random weights, on the CPU.

  python scripts/bench_hybrid.py chat      a 16-turn chat: each turn's prompt is the conversation so
                                           far and a new message; the prefix cache's hit rate per turn
  python scripts/bench_hybrid.py decode    the decode step's time at contexts of 256 to 4096 tokens,
                                           one sequence: the recurrent layers' part stays flat
  python scripts/bench_hybrid.py forms     one recurrent layer alone (Gated DeltaNet, Mamba-2) at two
                                           sizes, in both forms (tokens, chunked): a decode step of
                                           16 rows and a 512-token prompt chunk (recurrent_form)

Needs torch and transformers (the test extra) to write the checkpoints. --smoke: tiny sizes, a dry run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Qwen3.5's layer pattern (three linear-attention layers to one full) and a Qwen3 of the same
# widths whose every layer attends.
SHAPE = dict(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, initializer_range=0.02)
HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)
# Nemotron-H of the same widths: 6 Mamba-2 and 2 attention blocks, each followed by an MLP block
NEMOTRON = dict(layers_block_type=["linear_attention", "mlp"] * 3 + ["full_attention", "mlp"], mamba_num_heads=16,
                mamba_head_dim=64, ssm_state_size=64, n_groups=2, layer_norm_epsilon=1e-5)
NEMOTRON["layers_block_type"] = NEMOTRON["layers_block_type"] * 2


def checkpoints(root: str, smoke: bool) -> dict[str, str]:
    """The two checkpoints, written by a process of its own: torch's threads, once started, slow
    the engine's steps in the process that started them."""
    folders = {"Qwen3.5 (6 linear + 2 full)": os.path.join(root, "hybrid"),
               "Nemotron-H (6 Mamba-2 + 2 full)": os.path.join(root, "nemotron"),
               "Qwen3 (8 full)": os.path.join(root, "full")}
    subprocess.run([sys.executable, __file__, "write", *folders.values(), *(["--smoke"] if smoke else [])], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return folders


def write(hybrid: str, nemotron: str, full: str, smoke: bool) -> None:
    from tests.conftest import make_checkpoint

    shape, hybrid_shape, nemotron_shape = SHAPE, HYBRID, NEMOTRON
    if smoke:
        shape = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
        hybrid_shape = dict(HYBRID, linear_key_head_dim=8, linear_value_head_dim=8)
        nemotron_shape = dict(NEMOTRON, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8)
    make_checkpoint(hybrid, "qwen3_5_text", **shape, **hybrid_shape)
    make_checkpoint(nemotron, "nemotron_h", **shape, **nemotron_shape)
    make_checkpoint(full, "qwen3", **shape)


def chat(folders: dict[str, str], turns: int, message: int, reply: int) -> None:
    from jaxengine import LLM, SamplingParams

    rng = np.random.default_rng(0)
    messages = [rng.integers(3, 256, message).tolist() for _ in range(turns)]
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    rates = {}
    for name, folder in folders.items():
        llm = LLM(folder, skip_tokenizer_init=True, max_model_len=turns * (message + reply) + 64, block_size=16,
                  max_num_batched_tokens=512, max_num_seqs=4, token_buckets=[16, 512], request_buckets=[4],
                  progress=False)
        prompt, rates[name] = [], []
        for m in messages:
            prompt = prompt + m
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            rates[name].append((out.num_cached_tokens, len(prompt)))
            prompt = prompt + out.outputs[0].token_ids
    names = list(rates)
    print("| turn | prompt tokens | " + " | ".join(f"cached: {n}" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for t in range(turns):
        cells = " | ".join(f"{rates[n][t][0]} ({rates[n][t][0] / rates[n][t][1]:.0%})" for n in names)
        print(f"| {t + 1} | {rates[names[0]][t][1]} | {cells} |")
    for n in names:
        cached, total = map(sum, zip(*rates[n]))
        print(f"{n}: {cached} of {total} prompt tokens cached ({cached / total:.1%})")


def decode(folders: dict[str, str], contexts: list[int], steps: int) -> None:
    from jaxengine import LLM, SamplingParams

    times = {}
    for name, folder in folders.items():
        llm = LLM(folder, skip_tokenizer_init=True, max_model_len=max(contexts) + steps + 16, block_size=16,
                  max_num_batched_tokens=512, max_num_seqs=1, token_buckets=[1, 512], request_buckets=[1],
                  async_scheduling=False, enable_prefix_caching=False, compile_mode="eager", progress=False)
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        for context in contexts:
            prompt = np.random.default_rng(context).integers(3, 256, context).tolist()
            llm.engine.traces = []
            llm.generate([prompt], params, use_tqdm=False)
            decode_steps = [t.step_s for t in llm.engine.traces if t.num_decode_tokens and not t.num_prefill_tokens]
            times[name, context] = statistics.median(decode_steps[2:]) * 1e3
    names = list(folders)
    print("| context | " + " | ".join(f"{n} ms/step" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for context in contexts:
        print(f"| {context} | " + " | ".join(f"{times[n, context]:.2f}" for n in names) + " |")
    for n in names:
        print(f"{n}: {times[n, contexts[-1]] / times[n, contexts[0]]:.2f}x the step time from {contexts[0]} "
              f"to {contexts[-1]} tokens of context")


def forms(smoke: bool) -> None:
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxengine.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
    from jaxengine.models.mamba2 import Mamba2, Mamba2Shape

    layers = [("Gated DeltaNet", "bench width (8 heads of 64)", GatedDeltaNet, GatedDeltaNetShape(512, 4, 8, 64, 64)),
              ("Gated DeltaNet", "wider (32 heads of 128)", GatedDeltaNet, GatedDeltaNetShape(1024, 16, 32, 128, 128)),
              ("Mamba-2", "bench width (16 heads of 64, state 64)", Mamba2, Mamba2Shape(512, 16, 64, 64, 2)),
              ("Mamba-2", "wider (32 heads of 64, state 128)", Mamba2, Mamba2Shape(1024, 32, 64, 128, 8))]
    steps = [("decode, 16 rows", 16, 16), ("prompt chunk, 512 tokens", 1, 512)]
    if smoke:
        layers = [(n, "tiny", cls, GatedDeltaNetShape(64, 2, 4, 8, 8) if cls is GatedDeltaNet else
                   Mamba2Shape(64, 4, 8, 8, 2)) for n, _, cls, _ in layers[::2]]
        steps = [("decode, 4 rows", 4, 4), ("prompt chunk, 32 tokens", 1, 32)]
    print("| layer | size | step | tokens form ms | chunked form ms |")
    print("|---|---|---|---|---|")
    for name, size, cls, shape in layers:
        layer = cls(shape, jnp.float32, rngs=nnx.Rngs(0))
        conv_shape, state_shape = shape.state_shapes()
        for step_name, rows, tokens in steps:
            x = jax.random.normal(jax.random.key(0), (tokens, shape.hidden_size)) * 0.1
            token_rows = jnp.arange(tokens, dtype=jnp.int32) if rows == tokens else jnp.zeros(tokens, jnp.int32)
            conv, state = jnp.zeros((rows, *conv_shape)), jnp.zeros((rows, *state_shape))
            times = []
            for form in ("tokens", "chunked"):
                layer.recurrent_form = form
                graphdef, params = nnx.split(layer)
                fn = jax.jit(lambda params, x, graphdef=graphdef: nnx.merge(graphdef, params)(
                    x, token_rows, conv, state, one_token_rows=jnp.asarray(rows == tokens), num_valid=tokens))
                jax.block_until_ready(fn(params, x))
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(5):
                        out = fn(params, x)
                    jax.block_until_ready(out)
                    best = min(best, (time.perf_counter() - start) / 5 * 1e3)
                times.append(best)
            print(f"| {name} | {size} | {step_name} | {times[0]:.2f} | {times[1]:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if sys.argv[1:2] == ["write"]:             # (the checkpoints' own process)
        write(*sys.argv[2:5], "--smoke" in sys.argv)
        return
    parser.add_argument("what", choices=["chat", "decode", "forms"])
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per context")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a dry run")
    args = parser.parse_args()
    if args.what == "forms":
        return forms(args.smoke)
    with tempfile.TemporaryDirectory() as root:
        folders = checkpoints(root, args.smoke)
        if args.what == "chat":
            chat(folders, 3 if args.smoke else args.turns, 20, 24)
        else:
            decode(folders, [64, 128] if args.smoke else [int(c) for c in args.contexts.split(",")],
                   6 if args.smoke else args.steps)


if __name__ == "__main__":
    main()
