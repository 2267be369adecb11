"""Writes docs/configuration.md, the engine options' reference, from ``EngineArgs`` (each field's
flag, keyword, default, choices and help text); ``tests/test_docs.py`` checks the page is current.

    python scripts/docs_configuration.py
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxengine.engine_args import EngineArgs  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
INTRO = """**Engine options** are one dataclass, `EngineArgs` (`jaxengine/engine_args.py`, vLLM's name):
each field's default and help text make the `serve` / `generate` flags
(`--max-num-batched-tokens`, `--x/--no-x` for booleans, comma-separated lists), the `LLM(...)`
keyword arguments (an unknown one is a TypeError naming it) and, through
`create_engine_config(model_config)`, the frozen `EngineConfig` with the KV pool sized. Adding an
option is adding a field. `python -m jaxengine.serve --help` lists them all: the budget and
batch (`max_num_batched_tokens`, `max_num_seqs`, `max_model_len`), the KV cache (`block_size`,
`num_kv_blocks`, `kv_cache_memory_bytes` on the CPU, `gpu_memory_utilization`, `swap_space`,
`watermark`, `enable_prefix_caching`), the scheduler (`enable_chunked_prefill`,
`long_prefill_token_threshold`, `max_num_partial_prefills`, `preemption_mode`,
`scheduling_policy`, `scheduler_delay_factor`), the device side (`dtype`, `attention_backend`,
`skip_kernel_check`, `async_scheduling`, `token_buckets`, `request_buckets`,
`tensor_parallel_size`), several processes (`distributed_coordinator`, `num_processes`,
`process_id`, `distributed_timeout`: [parallelism](parallelism.md)), step traces (`trace_file`:
[how the engine works](engine.md)). `dtype="auto"` is
float32 on the CPU (where bfloat16 is slower) and the checkpoint's dtype on an accelerator
(`torch_dtype` / `dtype` in config.json, else the safetensors tensors'); float16 checkpoints
and quantised GGUF files run in bfloat16. An invalid value raises `ValueError` naming the field.
A `max_model_len` past the model's context length (`max_position_embeddings`, or YaRN's original
length × factor where longer) is refused naming both, unless `allow_long_max_model_len` (vLLM's
`VLLM_ALLOW_LONG_MAX_MODEL_LEN`)."""


def reference() -> str:
    hints = typing.get_type_hints(EngineArgs)
    rows = ["| flag | `LLM(...)` keyword | default | help |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            flag = f"{flag} / --no-{f.name.replace('_', '-')}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        help_text = f.metadata["help"] + (f" (one of: {', '.join(map(str, choices))})" if choices else "")
        cell = help_text.replace("|", "\\|")
        rows.append(f"| `{flag}` | `{f.name}` | `{default!r}` | {cell} |")
    return f"# Configuration\n\n{INTRO}\n\n## Every option\n\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    PAGE.write_text(reference())
    print(f"wrote {PAGE}")
