"""Greedy generation of the mixtures of experts through the whole engine is token-for-token
transformers' `generate`: as it comes, and with chunked prefill, preemption in a tiny KV pool and
prefix caching all at once."""
from tests.e2e.test_generate_vs_transformers import PROMPTS, engine, greedy, reference


def test_every_moe_architecture_matches_transformers_generate(moe_checkpoint):
    name, folder, hf_model = moe_checkpoint
    expected = reference(hf_model, PROMPTS)
    outs = greedy(engine(folder, async_scheduling=True), PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected, name

    # an 8-token budget chunks every prefill; 14 blocks of 4 cannot hold the batch, so requests
    # are preempted and recomputed; the second pass finds the shared prefix in the cache
    llm = engine(folder, max_num_batched_tokens=8, num_kv_blocks=14, preemption_mode="recompute",
                 enable_prefix_caching=True)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0
    # every token of a step is routed to k experts in each sparse layer, the padding to none
    cfg = llm.model_config
    for t in llm.engine.traces:
        tokens = t.num_prefill_tokens + t.num_decode_tokens
        assert len(t.expert_tokens) == (cfg.num_experts if tokens else 0)      # an empty step runs nothing
        assert sum(t.expert_tokens) == tokens * cfg.num_experts_per_tok * len(cfg.sparse_layers), t
    again = greedy(llm, PROMPTS[-2:])
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]
    assert [o.num_cached_tokens for o in again] == [12, 12]
