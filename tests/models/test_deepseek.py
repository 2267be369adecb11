"""DeepSeek-V3's parts on their own: the grouped sigmoid router against transformers', the two
forms of latent attention against each other over a paged cache, what a token costs the cache,
and a config that lacks a latent-attention field."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention, paged_attention_tiled
from jaxengine.kernels.paged_attention.latent import absorbed_attention, decompressed_attention
from jaxengine.models.moe import route_grouped
from tests.conftest import make_deepseek_checkpoint


def test_the_grouped_router_chooses_and_weighs_as_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(64, 32)
    with torch.no_grad():
        logits, want_weights, want_experts = router(x)
    weights, experts = route_grouped(jnp.asarray(logits.numpy()), 4, True, jnp.asarray(router.e_score_correction_bias.numpy()),
                                     4, 2, 2.5)
    order = np.argsort(want_experts.numpy(), axis=1)         # transformers' top-k comes unsorted
    want_experts = np.take_along_axis(want_experts.numpy(), order, 1)
    mine = np.argsort(np.asarray(experts), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), mine, 1), want_experts)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), mine, 1),
                               np.take_along_axis(want_weights.numpy(), order, 1), rtol=1e-6)
    # the bias steers the choice: without it another set of experts wins for some tokens
    _, unbiased = route_grouped(jnp.asarray(logits.numpy()), 4, True, jnp.zeros(16), 4, 2, 2.5)
    assert (np.sort(np.asarray(unbiased), 1) != want_experts).any(axis=1).sum() > 10


def _latent_case(seed: int = 0):
    """A paged cache of latents (R 16, rotary 8) for rows of 1 (decode), 7 and 12 (prefill chunks
    after a context) new tokens, and the queries and up-projections of 4 heads."""
    rng = np.random.default_rng(seed)
    block_size, rank, rotary, heads, nope, value = 4, 16, 8, 4, 16, 12
    rows = [(9, 1, [3, 5, 7]), (0, 7, [1, 2]), (4, 12, [8, 9, 10, 11])]
    md = AttentionMetadata.build(rows, block_size, num_tokens=24, max_blocks=5, num_rows=4)
    md = jax.tree.map(jnp.asarray, md)
    pages = jnp.asarray(rng.normal(size=(12, block_size, 1, rank + rotary)), jnp.float32)
    q_nope = jnp.asarray(rng.normal(size=(24, heads, nope)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(24, heads, rotary)), jnp.float32)
    w_uk = jnp.asarray(rng.normal(size=(rank, heads, nope)) * 0.3, jnp.float32)
    w_uv = jnp.asarray(rng.normal(size=(rank, heads, value)) * 0.3, jnp.float32)
    return q_nope, q_rope, pages, md, w_uk, w_uv


@pytest.mark.parametrize("kernel", [paged_attention, paged_attention_tiled], ids=["reference", "tiled"])
def test_absorbed_attention_equals_decompressed_over_pages(kernel):
    q_nope, q_rope, pages, md, w_uk, w_uv = _latent_case()
    scale = 0.17
    want = decompressed_attention(q_nope, q_rope, pages, md, w_uk, w_uv, scale=scale)
    got = absorbed_attention(q_nope, q_rope, pages, md, w_uk, w_uv, scale=scale, attention_fn=kernel)
    assert want.shape == (24, 4, 12)
    np.testing.assert_allclose(np.asarray(got)[:20], np.asarray(want)[:20], rtol=2e-5, atol=2e-5)
    # and it is attention: a token's output moves when a key it sees changes, not when one it doesn't
    moved = pages.at[3, 1].add(1.0)                           # row 0's position 1 (block 3, offset 1)
    again = absorbed_attention(q_nope, q_rope, moved, md, w_uk, w_uv, scale=scale, attention_fn=kernel)
    assert not np.allclose(np.asarray(again)[0], np.asarray(got)[0])
    np.testing.assert_array_equal(np.asarray(again)[1:20], np.asarray(got)[1:20])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 folder, built once; a test edits a copy of it (``copy_of``)."""
    folder = tmp_path_factory.mktemp("deepseek-unit")
    make_deepseek_checkpoint(folder, "no-q-lora")
    return folder


def copy_of(checkpoint, tmp_path):
    import shutil

    return shutil.copytree(checkpoint, tmp_path / "copy")


def test_a_token_costs_the_cache_one_latent_and_one_rotary_key(checkpoint):
    from jaxengine import EngineArgs
    from jaxengine.models.weights import safetensors_files

    cfg, _ = safetensors_files(checkpoint)
    assert cfg.kv_cache_parts == ((1, 16 + 8),)
    assert cfg.kv_elements_per_token == 3 * 24                               # 3 layers
    args = EngineArgs(block_size=4)
    assert args.kv_bytes_per_block(cfg, jnp.float32) == 3 * 24 * 4 * 4
    # per-head keys and values would hold 4 heads x (16 + 8 + 12) numbers per layer
    assert cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) == 6 * 24


def test_a_config_without_kv_lora_rank_is_refused_naming_it(checkpoint, tmp_path):
    from jaxengine.models.weights import load_model

    folder = copy_of(checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["kv_lora_rank"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: kv_lora_rank is missing; a deepseek_v3 model needs it"):
        load_model(folder)


@pytest.mark.parametrize("change, message", [
    (dict(n_group=3), r"n_group \(3\) must divide n_routed_experts \(8\)"),
    (dict(topk_group=5), r"topk_group \(5\) must be between 1 and n_group \(4\)"),
    (dict(n_group=8, topk_group=2), r"n_group \(8\): each group needs 2 experts or more"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) exceeds the experts of the topk_group \(2\) groups "
                                  r"kept \(4\)"),
    (dict(drop="q_lora_rank"), r"config\.json: q_lora_rank is missing; .* \(null where it has none\)"),
    (dict(drop="n_group"), r"config\.json: n_group is missing"),
])
def test_expert_groups_and_fields_that_cannot_work_are_refused_by_name(checkpoint, tmp_path, change, message):
    from jaxengine.models.weights import load_model

    folder = copy_of(checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    if "drop" in change:
        del config[change["drop"]]
    else:
        config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_the_router_scores_in_float32_in_a_bfloat16_model(checkpoint):
    """As DeepSeek-V3's reference keeps it: a bfloat16 correction bias rounds coarsely enough to
    change which experts win."""
    from jaxengine.models.weights import load_model

    model, cfg = load_model(checkpoint, jnp.bfloat16)
    moe = model.sparse_mlp
    assert moe.router[...].dtype == moe.score_correction_bias[...].dtype == jnp.float32
    assert moe.experts.gate_proj[...].dtype == model.layers.self_attn.kv_b_proj[...].dtype == jnp.bfloat16
    assert cfg.num_kv_heads == cfg.num_heads                    # no KV heads of its own to split


def test_lora_on_latent_attention_is_refused_rather_than_ignored(checkpoint):
    from jaxengine import LLM

    with pytest.raises(ValueError, match="enable_lora: adapters on DeepseekV3ForCausalLM's latent attention are not"):
        LLM(checkpoint, skip_tokenizer_init=True, enable_lora=True, num_kv_blocks=16, max_model_len=32,
            progress=False)
