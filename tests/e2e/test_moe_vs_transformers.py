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
