"""Hybrid models (Qwen3.5: Gated DeltaNet layers, whose memory is a recurrent state per sequence,
among gated full-attention layers; Nemotron-H: Mamba-2, attention, MLP and expert blocks) through the
whole engine give transformers' greedy tokens: as they come, with chunked prefill, preemption by
recompute in a tiny pool and prefix caching (hits resume from state snapshots), swapping groups of
two, beam search, tensor and expert parallelism."""
import pytest

from jaxengine import SamplingParams
from tests.e2e.test_generate_vs_transformers import PROMPTS, engine, greedy, greedy_under_pressure, reference


def make(tmp_path_factory, name: str):
    import torch

    from tests import conftest

    model_type, overrides = getattr(conftest, name)
    folder = tmp_path_factory.mktemp(name.lower())
    hf = conftest.make_checkpoint(folder, model_type, **overrides)
    if model_type == "nemotron_h":       # Mamba-2's decays and skips, the routers' biases away from their start
        torch.manual_seed(1)
        with torch.no_grad():
            for name_, p in hf.named_parameters():
                if name_.endswith(("A_log", ".D")):
                    p.copy_(torch.randn_like(p))
            for name_, b in hf.named_buffers():
                if name_.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.5)
        hf.save_pretrained(folder)
    return folder, hf, reference(hf, PROMPTS)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return make(tmp_path_factory, "QWEN3_5")


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return make(tmp_path_factory, "QWEN3_5_MOE")


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    return make(tmp_path_factory, "NEMOTRON_H")


@pytest.fixture(scope="module")
def nemotron_h_moe(tmp_path_factory):
    return make(tmp_path_factory, "NEMOTRON_H_MOE")


def states_released(llm) -> bool:
    """Every state slot back in the pool (snapshots among them, cached but free)."""
    pool = llm.engine.scheduler.kv.state_pool
    return pool.num_free_blocks == pool.num_usable_blocks


def test_qwen3_5_matches_transformers_generate(qwen3_5):
    folder, _, expected = qwen3_5
    llm = engine(folder, async_scheduling=True)
    cfg = llm.model_config
    assert (cfg.linear_attention_layers, cfg.kv_layers, cfg.rotary_dim) == ((0, 1, 2, 4, 5, 6), (3, 7), 4)
    # its 2 attention layers keep KV; each sequence's 6 recurrent layers keep one state slot
    assert llm.runner.kv_caches[0].shape[0] == 2 and llm.runner.kv_caches[2].shape[:2] == (6, 4 * 8 + 1)
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert states_released(llm)
    # chunks of 8 tokens carry the state from one step to the next; preemption recomputes from
    # token 0; a second pass of the shared prefix resumes after 12 tokens from a snapshot
    assert states_released(greedy_under_pressure(folder, expected, "qwen3.5"))


def test_nemotron_h_matches_transformers_generate(nemotron_h):
    """Its blocks one part each, in a pattern with no shorter period (the layers run as one
    unrolled trip): Mamba-2 states, attention without RoPE, squared-ReLU MLPs."""
    folder, hf, expected = nemotron_h
    llm = engine(folder, async_scheduling=True)
    cfg = llm.model_config
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert (cfg.linear_attention_layers, cfg.kv_layers, cfg.dense_layers, cfg.rotary_dim) == (
        (0, 2, 5), (3, 6), (1, 4, 7), 0)
    # 2 attention layers keep KV; each sequence's 3 Mamba-2 layers keep a convolution window and
    # an SSM state ([4 heads, 8, 8]) in one slot
    assert llm.runner.kv_caches[0].shape[0] == 2 and llm.runner.kv_caches[3].shape == (3, 4 * 8 + 1, 4 * 8 * 8)
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert states_released(llm)
    assert states_released(greedy_under_pressure(folder, expected, "nemotron-h"))


@pytest.mark.parametrize("model", ["qwen3_5", "nemotron_h_moe"])
def test_the_chunked_form_gives_the_same_tokens(model, request):
    """The recurrent layers in segments of a row's tokens (``recurrent_form="chunked"``, the form
    accelerators run): prompts in chunks of 16 tokens cut into segments at snapshots, decode rows
    at once, and a second pass resuming from snapshots."""
    folder, _, expected = request.getfixturevalue(model)
    llm = engine(folder, recurrent_form="chunked", max_num_batched_tokens=16, enable_prefix_caching=True,
                 async_scheduling=True)
    assert [o.outputs[0].token_ids for o in greedy(llm, PROMPTS)] == expected
    again = greedy(llm, PROMPTS[-2:])
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]
    assert [o.num_cached_tokens for o in again] == [12, 12] and states_released(llm)


@pytest.mark.parametrize("model", ["qwen3_5", "nemotron_h"])
def test_swapped_groups_take_their_states_along(model, request):
    folder, _, expected = request.getfixturevalue(model)
    llm = engine(folder, num_kv_blocks=14, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False,
                 async_scheduling=True)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS, n=2)
    assert sum(t.num_blocks_swapped_out for t in llm.engine.traces) > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
    assert states_released(llm)


@pytest.mark.parametrize("model", ["qwen3_5", "nemotron_h"])
def test_a_multi_turn_chat_hits_the_prefix_cache_as_full_attention_does(model, request, tmp_path):
    """Each turn's prompt is the conversation so far (the last prompt and its reply) and a new
    message: it resumes from the snapshot at the last block boundary of what it shares, the
    tokens a full-attention model of the same size finds cached, and its tokens are transformers'."""
    from tests.conftest import make_checkpoint

    folder, hf, _ = request.getfixturevalue(model)
    make_checkpoint(tmp_path, "qwen3", num_hidden_layers=2, head_dim=16)       # full attention, the same size
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached = {}
    for name, path, oracle in (("hybrid", folder, hf), ("full", tmp_path, None)):
        llm = engine(path, enable_prefix_caching=True)
        prompt, cached[name] = [], []
        for turn in range(4):
            prompt = prompt + [200 + turn, 17, 33 + turn]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            reply = out.outputs[0].token_ids
            if oracle is not None:
                assert reply == reference(oracle, [prompt], max_tokens=6)[0], turn
            cached[name].append(out.num_cached_tokens)
            prompt = prompt + reply
    assert cached["hybrid"] == cached["full"] == [0, 8, 16, 24]


def test_beam_search_forks_copy_the_state(qwen3_5):
    from tests.e2e import test_beam_search_vs_transformers as beams

    folder, hf, _ = qwen3_5
    expected = [beams.reference(hf, prompt, 3) for prompt in beams.PROMPTS]
    llm = beams.engine(folder, num_kv_blocks=40, swap_space=0.01)
    beams.assert_same(beams.beam_search(llm, beams.PROMPTS, 3), expected)
    assert states_released(llm)


@pytest.mark.parametrize("model", ["qwen3_5", "nemotron_h"])
def test_tensor_parallel_gives_the_same_tokens(model, request):
    folder, _, expected = request.getfixturevalue(model)
    llm = engine(folder, tensor_parallel_size=2)
    assert llm.model.attention_layers.q_proj[...].sharding.spec[2] == "model"     # [L, D, N, H]: by heads
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_qwen3_5_moe_matches_transformers_generate(qwen3_5_moe):
    folder, _, expected = qwen3_5_moe
    llm = engine(folder, async_scheduling=True)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    cfg = llm.model_config                     # every layer routes each token to 3 of its 8 experts
    assert all(sum(t.expert_tokens) == (t.num_prefill_tokens + t.num_decode_tokens) * 3 * 8
               for t in llm.engine.traces if t.expert_tokens)
    assert cfg.num_experts == 8 and states_released(greedy_under_pressure(folder, expected, "qwen3.5-moe"))


def test_qwen3_5_moe_under_expert_parallelism(qwen3_5_moe):
    folder, _, expected = qwen3_5_moe
    llm = engine(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    assert llm.model.layers.mlp.experts.gate_proj[...].sharding.spec[1] == "model"     # [L, E, D, F]: by experts
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_nemotron_h_with_experts_matches_transformers_generate(nemotron_h_moe, tmp_path):
    """Its two expert blocks route each token to 2 of 8 squared-ReLU experts in a latent width."""
    import dataclasses
    import json

    from jaxengine.models.weight_cache import _WEIGHTS, cached_config

    folder, hf, expected = nemotron_h_moe
    llm = engine(folder, async_scheduling=True)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    cfg = llm.model_config
    assert (cfg.sparse_layers, cfg.dense_layers, cfg.moe_latent_size) == ((1, 7), (4,), 40)
    biases = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters()) + biases
    # each token runs through 2 of a layer's 8 experts: 6 experts' up and down (40 x 32) unread
    assert cfg.num_active_params == cfg.num_params - 2 * 6 * 2 * 40 * 32
    (tmp_path / _WEIGHTS).mkdir()                  # the converted-weights cache keeps its blocks and shapes
    (tmp_path / _WEIGHTS / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert cached_config(tmp_path) == cfg
    assert all(sum(t.expert_tokens) == (t.num_prefill_tokens + t.num_decode_tokens) * 2 * 2
               for t in llm.engine.traces if t.expert_tokens)
    assert states_released(greedy_under_pressure(folder, expected, "nemotron-h-moe"))


def test_nemotron_h_with_experts_under_expert_parallelism(nemotron_h_moe):
    folder, _, expected = nemotron_h_moe
    llm = engine(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    assert llm.model.sparse_mlp.experts.up_proj[...].sharding.spec[1] == "model"     # [L, E, D, F]: by experts
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_vision_language_checkpoint_serves_its_language_model(tmp_path):
    """Qwen3.5 is published as a vision-language model (``Qwen3_5ForConditionalGeneration``: the
    language model under ``model.language_model.``, a vision tower beside it, multi-token
    prediction layers after): its language model loads from it as it is and gives the whole
    model's greedy tokens on text prompts."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.conftest import QWEN3_5, TINY

    text = {**TINY, **QWEN3_5[1], "num_hidden_layers": 4}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TINY["hidden_size"],
                  num_position_embeddings=16)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path)
    llm = engine(tmp_path)
    cfg = llm.model_config
    assert (cfg.architecture, cfg.language_model_of) == ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    outs = greedy(llm, PROMPTS[:4])
    assert [o.outputs[0].token_ids for o in outs] == reference(hf, PROMPTS[:4])
