"""Greedy generation of the mixtures of experts through the whole engine is token-for-token
transformers' `generate`: as it comes, and with chunked prefill, preemption in a tiny KV pool and
prefix caching all at once."""
from tests.e2e.test_generate_vs_transformers import PROMPTS, engine, greedy, greedy_under_pressure, reference


def test_every_moe_architecture_matches_transformers_generate(moe_checkpoint):
    name, folder, hf_model = moe_checkpoint
    expected = reference(hf_model, PROMPTS)
    outs = greedy(engine(folder, async_scheduling=True), PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected, name

    llm = greedy_under_pressure(folder, expected, name)       # chunks, preemption, the prefix cache
    # every token of a step is routed to k experts in each sparse layer, the padding to none
    cfg = llm.model_config
    for t in llm.engine.traces:
        tokens = t.num_prefill_tokens + t.num_decode_tokens
        assert len(t.expert_tokens) == (cfg.num_experts if tokens else 0)      # an empty step runs nothing
        assert sum(t.expert_tokens) == tokens * cfg.num_experts_per_tok * len(cfg.sparse_layers), t


def test_sliding_groups_hit_the_prefix_cache_with_only_their_window(tmp_path_factory):
    """gpt-oss's sliding layers (window 7, blocks of 4) keep their KV in groups of their own: a
    sequence holds there only the blocks its window reaches, however long it grows, and a prompt
    sharing another's 13 tokens resumes after 12 of them, from the full layers' blocks and the
    sliding layers' last two, which went back to the pool when the first sequence decoded past
    them. The tokens are transformers' all along."""
    from jaxengine import SamplingParams

    from tests.conftest import MOE_VARIANTS, make_checkpoint
    from tests.e2e.test_generate_vs_transformers import SHARED

    folder = tmp_path_factory.mktemp("gpt-oss-groups")
    model_type, overrides = MOE_VARIANTS["gpt-oss"]
    hf = make_checkpoint(folder, model_type, **overrides)
    first, second = SHARED + [7] + list(range(3, 19)), SHARED + [9, 4]
    expected = reference(hf, [first, second], max_tokens=20)
    llm = engine(folder, enable_prefix_caching=True)
    kv = llm.engine.scheduler.kv
    assert [w for w, _ in llm.model_config.kv_groups] == [None, 7, 7] and kv.group_windows == (None, 7, 7)
    # A block holds one layer's K and V (2 KV heads of 16, float32: 1 KiB); a long sequence's token
    # takes a place in the full group only: 512 tokens in the 128 blocks, 4 Mi a GiB (3 layers' worth before).
    assert llm.kv_cache_capacity() == {"tokens": 512, "tokens_per_gib": (1 << 30) * 4 // 1024}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    request = llm.engine.add_request("first", first, params)
    held = []
    while not request.is_finished:
        llm.engine.step()
        seq = request.seqs[0]
        if not request.is_finished:
            full, *sliding = kv.tables(seq)
            held.append((len(full), [len(t) - t.count(0) for t in sliding]))
    assert request.seqs[0].output_token_ids == expected[0]
    # After each step, the step at position p = 30 + i scheduled (async scheduling runs one ahead):
    # the full group holds a block per 4 tokens; a sliding group the blocks positions p-6..p span:
    # 3 where p is 0 or 1 mod 4, else 2.
    assert held == [(8 + (i + 2) // 4, [3 if (i + 2) % 4 < 2 else 2] * 2) for i in range(19)]
    out = llm.generate([second], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[1] and out.num_cached_tokens == 12
