"""Float32 models laid out as panels for the CPU matmul kernel (``models.panels``): which weights,
where, and the same logits and greedy tokens as the row-major model's."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.kernels.matmul import cpu_matmul
from jaxengine.models.panels import PANELED_KINDS, PanelParam, panel_for_cpu, plain
from jaxengine.models.weights import load_model

from tests.conftest import make_checkpoint
from tests.models.test_llama_vs_transformers import PROMPTS, oracle_logits, run_chunks


@pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU matmul kernel is not built here")
def test_a_float32_model_laid_out_as_panels_computes_as_the_row_major_one(tmp_path, monkeypatch):
    hf_model = make_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2,
                               tie_word_embeddings=True)
    laid, cfg = load_model(tmp_path)
    monkeypatch.setattr("jaxengine.models.weights.panel_for_cpu", lambda *a: 0)
    rows, _ = load_model(tmp_path)
    kinds = {path[-1] for path, node in nnx.iter_graph(laid) if isinstance(node, PanelParam)}
    # tied: the embedding is the head; k and v (2 heads of 8: 16 columns) are off the strips, kept as they are
    assert kinds == set(PANELED_KINDS) - {"lm_head", "k_proj", "v_proj"} | {"embed_tokens"}
    assert not any(isinstance(node, PanelParam) for _, node in nnx.iter_graph(rows))
    embed = laid.embed_tokens
    assert embed.panels.shape == (256 // 32, 64, 32) and embed.unpacked().shape == (256, 64)
    np.testing.assert_array_equal(plain(embed), plain(rows.embed_tokens))
    np.testing.assert_array_equal(plain(laid.layers.self_attn.o_proj), rows.layers.self_attn.o_proj[...])
    ids = jnp.asarray([0, 17, 255, 31, 32, 17])                            # a token's row gathered from its strip
    np.testing.assert_array_equal(laid.embed(ids), rows.embed(ids))
    for ids in PROMPTS[1:3]:
        ours = run_chunks(laid, cfg, ids, [len(ids)])
        # the strips sum in their own order (AVX2's and AVX-512's differ from OpenBLAS's): f32 rounding
        np.testing.assert_allclose(ours, run_chunks(rows, cfg, ids, [len(ids)]), atol=5e-5, rtol=0)
        np.testing.assert_allclose(ours, oracle_logits(hf_model, ids), atol=1e-4, rtol=0)
        assert (ours.argmax(-1) == oracle_logits(hf_model, ids).argmax(-1)).all()
    assert panel_for_cpu(rows, np.float32, devices=2) == 0 and panel_for_cpu(rows, jnp.bfloat16, devices=1) == 0
    assert panel_for_cpu(rows, np.float32, devices=1) == len(kinds)
