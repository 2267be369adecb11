"""Tensor parallelism on 8 simulated CPU devices: the same greedy tokens as transformers at every
mesh size, the collectives XLA should insert and none it should not, no compilation after
start-up, and a KV pool sized by each device's share of a block."""
import collections
import re

import jax
import numpy as np
import pytest

from jaxengine import EngineArgs, LLM, SamplingParams
from jaxengine.models.config import ModelConfig
from jaxengine.models.mesh import kv_heads_per_device, mesh_model_config
from tests.e2e.test_generate_vs_transformers import reference

RNG = np.random.default_rng(7)
SHARED = RNG.integers(3, 256, 13).tolist()
PROMPTS = [RNG.integers(3, 256, n).tolist() for n in (1, 6, 19, 30)] + [SHARED + [7], SHARED + [9, 4]]
MAX_TOKENS = 10
# 8 query heads over 2 KV heads: at TP 4 and 8 there are fewer KV heads than devices.
ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", dict(head_dim=32))}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    from tests.conftest import make_checkpoint

    model_type, overrides = ARCHS[request.param]
    folder = tmp_path_factory.mktemp(f"tp-{request.param}")
    hf = make_checkpoint(folder, model_type, num_attention_heads=8, num_key_value_heads=2, **overrides)
    return folder, reference(hf, PROMPTS, MAX_TOKENS)


def tp_engine(folder, tp, **options):
    """Chunked prefill (16-token budget), prefix caching, and a pool small enough to preempt."""
    base = dict(skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=8, block_size=4,
                max_model_len=64, num_kv_blocks=16, swap_space=0.001, enable_prefix_caching=True,
                token_buckets=[8, 16], request_buckets=[8], progress=False, tensor_parallel_size=tp,
                compile_mode="eager")                       # the test checks the schedule: every bucket from the start
    return LLM(folder, **{**base, **options})


def greedy_tokens(llm, prompts, n=1):
    llm.engine.traces = []
    with llm.runner.forbid_compiles():            # no compilation after start-up
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n),
                            use_tqdm=False)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks          # nothing leaked
    return outs


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_greedy_tokens_equal_transformers_at_every_mesh_size(arch, tp):
    folder, expected = arch
    llm = tp_engine(folder, tp)
    assert llm.runner.kv_caches[0].sharding.mesh.size == tp
    outs = greedy_tokens(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0       # the small pool preempted
    assert max(t.num_prefill_tokens for t in llm.engine.traces) == 16  # the 30-token prompt was chunked
    again = greedy_tokens(llm, PROMPTS[-2:])                            # the shared prefix is cached now
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]
    assert [o.num_cached_tokens for o in again] == [12, 12]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("tp-quantized")
    make_checkpoint(folder, "llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)
    return folder           # down_proj's share of 128 rows per device: the same groups of 128 at TP 1 and 2


def test_quantized_weights_split_over_two_devices_give_one_devices_tokens(llama_folder):
    # int4: packed values, scales and offsets, each split like the weight (int8 shares the layout)
    folder, scheme = llama_folder, "int4"
    one = greedy_tokens(tp_engine(folder, 1, quantization=scheme), PROMPTS)
    two = tp_engine(folder, 2, quantization=scheme)
    assert two.runner.kv_caches[0].sharding.mesh.size == 2
    assert two.model.layers.mlp.down_proj.q.sharding.spec[1] == "model"          # [L, F/P, D] split by F
    assert [o.outputs[0].token_ids for o in greedy_tokens(two, PROMPTS)] == [o.outputs[0].token_ids for o in one]


def test_a_checkpoint_stored_quantized_splits_over_two_devices_as_one_device_runs_it(llama_folder, tmp_path):
    # AWQ int4 in groups of 32: repacked on load, float32 scales and offsets split like the values
    import torch
    from transformers import AutoModelForCausalLM

    from tests.models.test_stored_quantization import int4_groups, linears, pack_words, to_int32, write

    hf_model = AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    replaced = {}
    for name, w in linears(hf_model):
        values, zero, scale, _ = int4_groups(w, 32)
        replaced[name[:-len(".weight")]] = {"qweight": to_int32(pack_words(values.T, order)),
                                            "qzeros": to_int32(pack_words(zero.T, order)),
                                            "scales": scale.T.to(torch.float16)}
    folder = write(tmp_path / "awq", hf_model, replaced, {"quant_method": "awq", "bits": 4, "group_size": 32})
    one = greedy_tokens(tp_engine(folder, 1), PROMPTS)
    two = tp_engine(folder, 2)
    assert two.model.layers.mlp.down_proj.offset.sharding.spec[1] == "model"
    assert [o.outputs[0].token_ids for o in greedy_tokens(two, PROMPTS)] == [o.outputs[0].token_ids for o in one]


def test_swapped_groups_come_back_whole_from_a_sharded_cache(arch):
    folder, expected = arch
    llm = tp_engine(folder, 4, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    outs = greedy_tokens(llm, PROMPTS, n=2)
    assert sum(t.num_blocks_swapped_out for t in llm.engine.traces) > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]


def _collectives(executable) -> collections.Counter:
    """(op, result shape) -> count in the compiled step (a scan body's op counts once)."""
    ops = collections.Counter()
    for m in re.finditer(r"= (\w+\[[\d,]*\])\S* (all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(",
                         executable.as_text()):
        ops[(m.group(2), m.group(1))] += 1
    return ops


def test_the_step_all_reduces_row_split_outputs_and_gathers_no_weights_or_cache(tmp_path):
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2)
    llm = tp_engine(tmp_path, 4, token_buckets=[16])
    ops = _collectives(llm.runner._executables[(16, 8)])
    # The embedding (split by vocabulary) and, in the layer body, o_proj and down_proj (split by
    # rows): their [T, D] partial sums are all-reduced.
    assert ops[("all-reduce", "f32[16,64]")] == 3
    gathers = [shape for (op, shape), _ in ops.items() if op == "all-gather"]
    sizes = [int(np.prod([int(d) for d in re.findall(r"\d+", s.split("[")[1])])) for s in gathers]
    assert "f32[8,256]" in gathers            # the sample rows' logits, gathered for the sampler
    # Nothing as large as a weight shard of the MLP or a layer's KV cache is ever gathered: the
    # largest gather is the prompt-logprob logits of the 16 tokens (16 x 256).
    smallest_weight = 64 * 128
    cache_layer = 16 * 4 * 8 * 8
    assert max(sizes) <= 16 * 256 < smallest_weight * 2 and max(sizes) < cache_layer * 2
    params = {tuple(v.shape) for v in jax.tree.leaves(llm.runner.state)}
    assert not any(tuple(int(d) for d in re.findall(r"\d+", s.split("[")[1])) in params for s in gathers)


def test_the_kv_pool_follows_each_devices_share_of_a_block(tmp_path):
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2)
    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 8, 2, 8)
    # One block: 2 layers x 4 slots x 8 head size x (k, v) x 4 bytes = 512 bytes per KV head.
    budget = 512 * 2 * 100                         # 100 blocks of both heads, per device
    blocks = {tp: EngineArgs(block_size=4, kv_cache_memory_bytes=budget, tensor_parallel_size=tp)
              .create_engine_config(mesh_model_config(cfg, tp)).cache.num_gpu_blocks for tp in (1, 2, 4, 8)}
    assert blocks == {1: 100, 2: 200, 4: 200, 8: 200}     # 2 heads, 1 head, then 1 (repeated) head each
    assert [kv_heads_per_device(cfg, tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    llm = LLM(tmp_path, skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=8, block_size=4,
              max_model_len=64, kv_cache_memory_bytes=budget, token_buckets=[16], request_buckets=[8],
              progress=False, tensor_parallel_size=4)
    k = llm.runner.kv_caches[0]
    assert llm.config.cache.num_gpu_blocks == 200 and k.shape == (2, 200, 4, 4 * 8)     # heads one after another
    assert {s.data.shape for s in k.addressable_shards} == {(2, 200, 4, 8)}
    assert len(k.addressable_shards) == 4


def test_a_mesh_that_does_not_split_the_heads_is_refused(tmp_path):
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not split the 8 attention heads"):
        tp_engine(tmp_path, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 16 devices needed, 8 available"):
        tp_engine(tmp_path, 16)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: must be an integer >= 1"):
        tp_engine(tmp_path, 0)
