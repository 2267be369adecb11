"""Greedy generation through the whole engine is token-for-token transformers' `generate`, whatever
the budget, pool, preemption mode, prefix caching, group size or async scheduling (tiny random
checkpoints)."""
import numpy as np
import pytest
import torch

from jaxengine import LLM, SamplingParams

MAX_TOKENS = 10
RNG = np.random.default_rng(1)
SHARED = RNG.integers(3, 256, 13).tolist()                      # a shared prefix for the prefix cache
PROMPTS = [RNG.integers(3, 256, n).tolist() for n in (1, 5, 11, 17, 30)] + [SHARED + [7], SHARED + [9, 4]]


def reference(hf_model, prompts, max_tokens=MAX_TOKENS):
    out = []
    hf_model.generation_config.eos_token_id = None      # like ignore_eos: EOS neither stops nor is masked
    with torch.no_grad():
        for ids in prompts:
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def engine(folder, **options):
    """One step bucket (the limits themselves): an engine compiles one step, not three."""
    base = dict(skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=8, block_size=4,
                max_model_len=64, num_kv_blocks=128, swap_space=0.001, progress=False, compile_mode="eager")
    merged = {**base, **options}
    return LLM(folder, token_buckets=[merged["max_num_batched_tokens"]], request_buckets=[merged["max_num_seqs"]],
               **merged)


def greedy(llm, prompts, n=1):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    with llm.runner.forbid_compiles():
        outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.engine.scheduler
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks and not sched.has_unfinished_requests()
    return outs


def num_groups(folder) -> int:
    """The checkpoint's layer groups (``ModelConfig.kv_groups``)."""
    from transformers import AutoConfig

    from jaxengine.models.config import ModelConfig

    return len(ModelConfig.from_hf(AutoConfig.from_pretrained(folder)).kv_groups)


def greedy_under_pressure(folder, expected, name=""):
    """An 8-token budget chunks every prefill; 14 blocks of 4 cannot hold the batch, so requests are
    preempted and recomputed; the shared prefix is cached: the greedy tokens are ``expected`` all
    the same, and a second pass of the prefix's prompts finds 12 of their tokens cached. -> the
    engine, its traces kept. (A model whose layers keep KV in groups gets the same memory: a block
    then holds one group's layers, so 13 blocks' worth per group. Its sliding groups give back the
    prefix's blocks as the first pass decodes past them, the first blocks the pool evicts: their
    hits are ``test_sliding_groups_hit_the_prefix_cache_with_only_their_window``'s.)"""
    groups = num_groups(folder)
    llm = engine(folder, max_num_batched_tokens=8, num_kv_blocks=1 + 13 * groups,
                 preemption_mode="recompute", enable_prefix_caching=True)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0
    again = greedy(llm, PROMPTS[-2:])
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]
    if groups == 1:
        assert [o.num_cached_tokens for o in again] == [12, 12]
    return llm


def test_every_architecture_matches_transformers_generate(checkpoint):
    _, folder, hf_model = checkpoint
    outs = greedy(engine(folder, async_scheduling=True), PROMPTS)       # tokens fed on the device
    assert [o.outputs[0].token_ids for o in outs] == reference(hf_model, PROMPTS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("llama-e2e")
    hf = make_checkpoint(folder, "llama")
    return folder, hf, reference(hf, PROMPTS)


@pytest.mark.parametrize("name, options", [
    ("tiny budget: chunked prefill", dict(max_num_batched_tokens=8)),
    ("tiny pool: recompute", dict(num_kv_blocks=14, preemption_mode="recompute", enable_prefix_caching=False)),
    ("tiny pool: swap", dict(num_kv_blocks=14, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)),
    ("prefix caching", dict(enable_prefix_caching=True)),
    ("no chunked prefill, priority", dict(enable_chunked_prefill=False, scheduling_policy="priority")),
    ("async: tiny budget", dict(max_num_batched_tokens=8, async_scheduling=True)),
    ("async: tiny pool, recompute", dict(num_kv_blocks=14, preemption_mode="recompute", enable_prefix_caching=False,
                                         async_scheduling=True)),
    ("async: tiny pool, swap", dict(num_kv_blocks=14, preemption_mode="swap", swap_space=0.01,
                                    enable_prefix_caching=False, async_scheduling=True)),
])
def test_scheduling_never_changes_greedy_tokens(llama, name, options):
    folder, _, expected = llama
    llm = engine(folder, **options)
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    if name == "prefix caching":                      # again: now the shared prefix is cached
        again = greedy(llm, PROMPTS[-2:])
        assert [o.outputs[0].token_ids for o in again] == expected[-2:]
        assert [o.num_cached_tokens for o in again] == [12, 12]   # 3 full blocks of the 13-token prefix


def test_preemption_actually_happens_in_the_tiny_pool(llama):
    folder, _, expected = llama
    llm = engine(folder, num_kv_blocks=14, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS, n=2)
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0
    assert sum(t.num_blocks_swapped_out for t in llm.engine.traces) > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
