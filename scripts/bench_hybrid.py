"""Hybrid models (Qwen3.5: Gated DeltaNet layers with a recurrent state among full-attention
layers) against a full-attention model of the same size (Qwen3), tiny random weights, on the CPU.

  python scripts/bench_hybrid.py chat      a 16-turn chat: each turn's prompt is the conversation so
                                           far and a new message; the prefix cache's hit rate per turn
  python scripts/bench_hybrid.py decode    the decode step's time at contexts of 256 to 4096 tokens,
                                           one sequence: the recurrent layers' part stays flat

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


def checkpoints(root: str, smoke: bool) -> dict[str, str]:
    """The two checkpoints, written by a process of its own: torch's threads, once started, slow
    the engine's steps in the process that started them."""
    folders = {"Qwen3.5 (6 linear + 2 full)": os.path.join(root, "hybrid"),
               "Qwen3 (8 full)": os.path.join(root, "full")}
    subprocess.run([sys.executable, __file__, "write", *folders.values(), *(["--smoke"] if smoke else [])], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return folders


def write(hybrid: str, full: str, smoke: bool) -> None:
    from tests.conftest import make_checkpoint

    shape, hybrid_shape = SHAPE, HYBRID
    if smoke:
        shape = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
        hybrid_shape = dict(HYBRID, linear_key_head_dim=8, linear_value_head_dim=8)
    make_checkpoint(hybrid, "qwen3_5_text", **shape, **hybrid_shape)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if sys.argv[1:2] == ["write"]:             # (the checkpoints' own process)
        write(sys.argv[2], sys.argv[3], "--smoke" in sys.argv)
        return
    parser.add_argument("what", choices=["chat", "decode"])
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per context")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a dry run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folders = checkpoints(root, args.smoke)
        if args.what == "chat":
            chat(folders, 3 if args.smoke else args.turns, 20, 24)
        else:
            decode(folders, [64, 128] if args.smoke else [int(c) for c in args.contexts.split(",")],
                   6 if args.smoke else args.steps)


if __name__ == "__main__":
    main()
