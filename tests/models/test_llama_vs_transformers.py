"""Full-sequence logits against transformers (PyTorch, CPU) for every supported architecture."""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import torch

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import make_forward
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.weights import load_model

BLOCK = 4
PROMPTS = [[5], [7, 3, 200, 41, 9, 9, 13], list(range(10, 33)), [int(x) for x in np.random.default_rng(0).integers(0, 256, 45)]]


def oracle_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def run_chunks(model, cfg, ids, chunks, num_blocks=32, kv_dtype=jnp.float32):
    """Prefill ``ids`` in the given chunk sizes through the paged cache; logits for every token."""
    state, forward = make_forward(model)
    caches = init_kv_caches(cfg, num_blocks, BLOCK, kv_dtype)
    table = list(range(1, 1 + -(-len(ids) // BLOCK)))
    out, done = [], 0
    for n in chunks:
        md = AttentionMetadata.build([(done, n, table)], BLOCK, num_tokens=n, max_blocks=16)
        caches, logits = forward(state, caches, jnp.asarray(ids[done:done + n]), md, jnp.arange(n))
        out.append(np.asarray(logits))
        done += n
    return np.concatenate(out)


def test_full_sequence_logits_match_transformers(checkpoint):
    name, folder, hf_model = checkpoint
    model, cfg = load_model(folder)
    for ids in PROMPTS:
        ours = run_chunks(model, cfg, ids, [len(ids)])
        ref = oracle_logits(hf_model, ids)
        assert ref.std() > 0.5, "logits too flat to compare argmax"
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0, err_msg=f"{name}, prompt of {len(ids)}")
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_chunked_prefill_through_the_paged_cache_equals_one_pass(checkpoint):
    name, folder, _ = checkpoint
    model, cfg = load_model(folder)
    ids = PROMPTS[3]
    one = run_chunks(model, cfg, ids, [len(ids)])
    chunked = run_chunks(model, cfg, ids, [3, 16, 1, 25])
    np.testing.assert_allclose(chunked, one, atol=1e-4, rtol=0)      # f32 sums in another order


def test_a_ragged_batch_with_padding_equals_each_request_alone(checkpoint):
    _, folder, hf_model = checkpoint
    model, cfg = load_model(folder)
    state, forward = make_forward(model)
    a, b = PROMPTS[1], PROMPTS[2]
    caches = init_kv_caches(cfg, 32, BLOCK)
    md = AttentionMetadata.build([(0, len(a), [3, 4]), (0, len(b), [7, 8, 9, 10, 11, 12])], BLOCK,
                                 num_tokens=64, max_blocks=16, num_rows=4)
    last = jnp.asarray([len(a) - 1, len(a) + len(b) - 1])
    caches, logits = forward(state, caches, jnp.asarray(a + b + [0] * (64 - len(a) - len(b))), md, last)
    np.testing.assert_allclose(np.asarray(logits[0]), oracle_logits(hf_model, a)[-1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1]), oracle_logits(hf_model, b)[-1], atol=1e-4, rtol=0)
    assert not np.isnan(np.asarray(caches[0])).any()



YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}


def test_yarn_rope_matches_transformers_past_the_original_context(tmp_path):
    # prompts to 45 positions, past the 16 YaRN stretches; with and without an explicit attention factor
    from jaxengine.models.layers import rope_attention_factor
    from jaxengine.models.weight_cache import _WEIGHTS, cached_config
    from tests.conftest import make_checkpoint

    for name, rope in (("yarn", YARN), ("yarn-factor", {**YARN, "attention_factor": 1.3, "beta_fast": 16.0})):
        hf = make_checkpoint(tmp_path / name, "qwen3", head_dim=32, rope_parameters=rope, max_position_embeddings=64)
        model, cfg = load_model(tmp_path / name)
        assert rope_attention_factor(cfg) == (1.3 if "attention_factor" in rope else 0.1 * np.log(4.0) + 1.0)
        for ids in PROMPTS[2:]:
            np.testing.assert_allclose(run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(hf, ids), atol=1e-4,
                                       rtol=0, err_msg=f"{name}, prompt of {len(ids)}")
    cached = tmp_path / "converted"                  # the converted-weights cache keeps the scaling's kind
    (cached / _WEIGHTS).mkdir(parents=True)
    (cached / _WEIGHTS / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert cached_config(cached) == cfg


def test_the_hidden_states_entering_chosen_layers_are_transformers_hidden_states(tmp_path):
    """What an EAGLE-3 head reads: the residual stream entering layers (0, 2, 3) of a 4-layer
    Llama, concatenated, against transformers' ``hidden_states[i]``; the logits unchanged."""
    import jax

    from tests.conftest import make_checkpoint

    hf_model = make_checkpoint(tmp_path, "llama", num_hidden_layers=4)
    model, cfg = load_model(tmp_path)
    ids = PROMPTS[2]
    caches = init_kv_caches(cfg, 16, BLOCK)
    md = AttentionMetadata.build([(0, len(ids), list(range(1, 8)))], BLOCK, num_tokens=len(ids), max_blocks=8)
    hidden, _, _, aux = jax.jit(lambda x, c, m: model.forward_with_aux_hidden(x, c, m, (0, 2, 3)))(
        jnp.asarray(ids), caches, md)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True)
    want = np.concatenate([ref.hidden_states[i][0].numpy() for i in (0, 2, 3)], axis=-1)
    assert aux.shape == (len(ids), 3 * cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(aux), want, atol=2e-5 * np.abs(want).max(), rtol=0)     # f32, |h| ~ 40
    logits = np.asarray(model.compute_logits(hidden))
    np.testing.assert_allclose(logits, ref.logits[0].numpy(), atol=1e-4, rtol=0)
