"""How many tokens of context a GiB of KV cache holds when sliding-window layers keep their KV in
groups of their own (the KV cache manager's layer groups) against one pool for all layers (every
layer keeping every token), measured by filling a pool through the manager.

    python scripts/bench_kv_groups.py [--gib 64] [--contexts 8192,32768] [--chunk 2048]

Each sequence of C tokens is prefilled in chunks as the scheduler gives them (its windowed groups
giving back what their windows passed before each chunk) and left at the decode of its next token;
sequences are added until the pool refuses one. Host-only: no model runs."""
from __future__ import annotations

import argparse

from jaxengine.config import CacheConfig
from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.models.config import ModelConfig
from jaxengine.models.mesh import kv_elements_per_device
from jaxengine.request import Request
from jaxengine.sampling_params import SamplingParams

BLOCK = 16
BYTES = 2        # bfloat16

# (name, config): the layer pattern, window and KV heads of each model.
SHAPES = {
    # gpt-oss-20b: 24 layers alternating sliding (window 128) and full, 8 KV heads of 64.
    "gpt-oss-20b": ModelConfig("gpt-oss", 201088, 2880, 2880, 24, 64, 8, 64, sliding_window=128,
                               full_attention_layers=tuple(range(1, 24, 2))),
    # Gemma 4's text layers as transformers' Gemma4TextConfig lays them out by default: 30 layers,
    # five sliding (window 512) to one full, 4 KV heads of 256 (its full layers' wider heads not modelled).
    "Gemma 4 pattern": ModelConfig("gemma4", 262144, 2304, 9216, 30, 8, 4, 256, sliding_window=512,
                                   full_attention_layers=tuple(range(5, 30, 6))),
}


def fill(cfg: ModelConfig, grouped: bool, gib: float, context: int, chunk: int) -> tuple[int, int]:
    """(sequences of ``context`` tokens the pool holds, blocks of the pool)."""
    per_block = kv_elements_per_device(cfg, 1, grouped=grouped) * BLOCK * BYTES
    windows = tuple(w for w, _ in cfg.kv_groups) if grouped else (None,)
    num_blocks = int(gib * (1 << 30)) // per_block
    kv = KVCacheManager(CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, watermark=0.0,
                                    enable_prefix_caching=False, group_windows=windows))
    held = 0
    while True:
        seq = Request(f"r{held}", [1] * context, SamplingParams()).seqs[0]
        while seq.num_computed_tokens < context:
            kv.slide(seq)
            n = min(chunk, context - seq.num_computed_tokens)
            if not kv.allocate_slots(seq, n):
                return held, num_blocks
            seq.num_computed_tokens += n
        kv.slide(seq)                               # as its first decode step would
        held += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=64.0)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args()
    print("| model shape | context | one pool: tokens per GiB | layer groups: tokens per GiB | ratio |")
    print("|---|---|---|---|---|")
    for name, cfg in SHAPES.items():
        for context in map(int, args.contexts.split(",")):
            one, _ = fill(cfg, False, args.gib, context, args.chunk)
            groups, _ = fill(cfg, True, args.gib, context, args.chunk)
            a, b = one * context / args.gib, groups * context / args.gib
            print(f"| {name} ({len(cfg.kv_groups)} groups of {cfg.kv_group_size}) | {context:,} | {a:,.0f} | "
                  f"{b:,.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
