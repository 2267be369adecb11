"""Run as a process of its own (``tests/runner/test_compiled_programs.py`` starts it) under XLA's own
flags, as the engine runs, none of the test suite's: an engine per configuration of a JSON file,
its programs compiled at start-up, and what the checks read of each compiled program, printed as
JSON on the last line: its largest temporary buffer and largest copy (XLA's buffer assignment and
its optimized HLO) and the bytes it updates in place."""
from __future__ import annotations

import json
import math
import re
import sys

# Small enough to compile quickly; a pool (2048 blocks) far larger than any weight of a tiny model.
# A host pool of a few blocks: swaps of 1 and 4 blocks compiled.
COMMON = dict(skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=4, block_size=16, max_model_len=64,
              num_kv_blocks=2048, swap_space=4e-5, progress=False, compile_mode="eager", token_buckets=[1, 16],
              request_buckets=[1, 4])
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1, "s16": 2, "u16": 2,
                 "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")


def largest_copy(hlo: str) -> int:
    """Bytes of the largest array an HLO ``copy`` makes."""
    return max((ELEMENT_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
                for dtype, dims in COPY.findall(hlo)), default=0)


def shard_bytes(array) -> int:
    """Bytes of one device's part of ``array``."""
    return array.addressable_shards[0].data.nbytes


def report(llm) -> dict:
    import jax

    runner = llm.runner
    caches = list(runner.kv_caches)
    draft_caches = [] if runner.drafter is None else list(runner.drafter.kv_caches)
    programs = {}
    for name, program in runner.compiled_programs().items():
        memory, cost = program.memory_analysis(), program.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        programs[name] = dict(temp=memory.temp_size_in_bytes, aliased=memory.alias_size_in_bytes,
                              copy=largest_copy(program.as_text()), bytes_accessed=cost.get("bytes accessed", 0.0))
    cache = caches[0]
    kv_per_token = sum(shard_bytes(c) for c in caches) // (cache.shape[1] * cache.shape[2])
    # A layer's part of an array of the caches ([L, P, S, K*H]; a one-layer head's is [P, S, K*H]),
    # and of a recurrent state pool ([Lr, slots, n]: a hybrid model's, after the KV arrays).
    kv, states = caches[:runner.num_kv_arrays], caches[runner.num_kv_arrays:]
    return dict(layer_slice=min(shard_bytes(c) // (c.shape[0] if c.ndim == 4 else 1) for c in kv + draft_caches),
                state_slice=min((shard_bytes(c) // c.shape[0] for c in states), default=None),
                caches=sum(map(shard_bytes, caches)), draft_caches=sum(map(shard_bytes, draft_caches)),
                weights=sum(map(shard_bytes, jax.tree.leaves(runner.state))), kv_per_token=kv_per_token,
                max_model_len=llm.config.scheduler.max_model_len, programs=programs)


def main(spec_file: str) -> None:
    from jaxengine import LLM

    reports = {}
    for config in json.loads(open(spec_file).read()):
        llm = LLM(config["model"], **{**COMMON, **config.get("options", {})})      # model None: the default
        reports[config["name"]] = report(llm)
        del llm
    print(json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1])
