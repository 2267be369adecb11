"""Models with weights kept quantized: online int8 / int4 against transformers running the same
quantization's dequantised weights, GGUF Q8_0 / Q4_0 / Q4_1 kept as stored against the same file
dequantised, the converted-weights cache holding the repacked form, and clear errors."""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from gguf import GGMLQuantizationType as Q

from jaxengine.kernels.matmul.quantized import TiledWeight, dequantize_reference, quantize, tiles_available, untile
from jaxengine.models.gguf import load_gguf
from jaxengine.paths import converted_cache_path
from jaxengine.models.quantization import QuantizedParam, TILED_KINDS, kind_of, online_plan, tile_for_cpu
from jaxengine.models.weights import load_model

from tests.conftest import make_checkpoint
from tests.models.test_llama_vs_transformers import PROMPTS, oracle_logits, run_chunks
from tests.models.test_weights import write_gguf


@pytest.fixture(scope="module", params=["untied", "tied-gqa4"])
def llama(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    extra = dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True) if "tied" in request.param else {}
    return folder, make_checkpoint(folder, "llama", **extra)


def dequantised_oracle(hf_model, cfg):
    """The transformers model with each weight ``cfg`` keeps quantized replaced by the reference
    quantization's dequantised values."""
    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, w in ref.state_dict().items():
            # transformers fuses the experts' gate and up [E, 2F, D]; rows are quantized one by one
            if (kind := kind_of(name.replace("experts.gate_up_proj", "experts.gate_proj"))) and (spec := cfg.quant_spec(kind)):
                fmt, group, offset = spec
                values, scale, zero = quantize(w.numpy(), fmt, group, axis=-1, offset=offset)
                w.copy_(torch.from_numpy(dequantize_reference(values, scale, zero, axis=-1)))
    return ref


@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_online_quantization_matches_transformers_on_the_dequantised_weights(llama, scheme):
    folder, hf_model = llama
    model, cfg = load_model(folder, quantization=scheme)
    tied = hf_model.config.tie_word_embeddings
    kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"}
    assert {k for k, *_ in cfg.quantization} == kinds | (set() if tied else {"lm_head"})
    head = cfg.head_dim
    assert cfg.quant_spec("o_proj") == ((scheme, head, False) if scheme != "int4" else ("int4", head, True))
    assert cfg.quant_spec("down_proj") == (scheme, 128, scheme == "int4")
    assert isinstance(model.layers.self_attn.q_proj, QuantizedParam)
    embedding = model.embed_tokens[...]
    embedding = untile(embedding) if isinstance(embedding, TiledWeight) else embedding
    assert embedding.q.shape == ((32, 256) if scheme == "int4" else (64, 256))     # kept [D, V]
    up = model.layers.mlp.up_proj[...]                       # int8 / int4 laid out as tiles where the CPU reads them so
    assert isinstance(up, TiledWeight) == (scheme != "fp8" and tiles_available())
    assert np.dtype(up.scale_dtype if isinstance(up, TiledWeight) else up.scale.dtype) == (
        np.float32 if scheme == "fp8" else np.float16)
    oracle = dequantised_oracle(hf_model, cfg)
    for ids in PROMPTS:
        ours, ref = run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(oracle, ids)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0, err_msg=f"{scheme}, prompt of {len(ids)}")
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("scheme", ["int4"])          # (int8's tiles: the kernel's tests)
def test_projections_laid_out_as_tiles_compute_as_the_row_major_ones(llama, scheme, monkeypatch):
    """Where the CPU kernel reads tiles, a loaded model's int8 / int4 projections and LM head are
    laid out so (a tied embedding's tokens gathered from its tiles); prefill (more than 8 rows: the same products) and decode (a row a step:
    summed in another order) give the row-major model's logits within float32's rounding, and the
    same greedy tokens. Not laid out on a mesh or for a bfloat16 model."""
    if not tiles_available():
        pytest.skip("the tiled layout serves a CPU with AVX2 or AVX-512 VNNI and VBMI only")
    folder, hf_model = llama
    tiled, cfg = load_model(folder, quantization=scheme)
    monkeypatch.setattr("jaxengine.models.weights.tile_for_cpu", lambda *a: 0)
    rows, _ = load_model(folder, quantization=scheme)
    kinds = {path[-1] for path, node in nnx.iter_graph(tiled)
             if isinstance(node, QuantizedParam) and isinstance(node[...], TiledWeight)}
    head = set() if hf_model.config.tie_word_embeddings else {"lm_head"}    # tied: the embedding is the head
    assert kinds == TILED_KINDS - {"lm_head"} | head
    assert not any(isinstance(node, QuantizedParam) and isinstance(node[...], TiledWeight)
                   for _, node in nnx.iter_graph(rows))
    ids = jnp.asarray([0, 17, 255, 16, 31, 17])                             # a token's column gathered from its tile
    np.testing.assert_array_equal(tiled.embed(ids), rows.embed(ids))
    for ids in PROMPTS[1:3]:
        whole = [len(ids)]                                  # (up to 8 tokens: as bytes, as a decode step)
        if len(ids) > 8:
            np.testing.assert_array_equal(run_chunks(tiled, cfg, ids, whole), run_chunks(rows, cfg, ids, whole))
        ours, ref = run_chunks(tiled, cfg, ids, [1] * len(ids)), run_chunks(rows, cfg, ids, [1] * len(ids))
        np.testing.assert_allclose(ours, ref, atol=5e-5, rtol=0)            # logits of a few units
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert tile_for_cpu(rows, np.float32, devices=2) == 0 and tile_for_cpu(rows, jnp.bfloat16, devices=1) == 0
    assert tile_for_cpu(rows, np.float32, devices=1) == len(kinds)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from tests.conftest import MOE_VARIANTS

    folder = tmp_path_factory.mktemp("moe")
    model_type, overrides = MOE_VARIANTS["qwen2-moe-shared-dense"]      # experts, a shared one, a dense layer
    return folder, make_checkpoint(folder, model_type, **overrides)


@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_a_mixtures_experts_are_kept_quantized_and_match_transformers_on_the_dequantised_weights(moe, scheme):
    folder, hf_model = moe
    model, cfg = load_model(folder, quantization=scheme)
    assert {k for k, *_ in cfg.quantization} >= {"experts.gate_proj", "experts.up_proj", "experts.down_proj",
                                                  "down_proj", "gate_proj"}
    assert cfg.quant_spec("experts.gate_proj") == ((scheme, 64, False) if scheme != "int4" else ("int4", 64, True))
    assert cfg.quant_spec("experts.down_proj") == (scheme, 32, scheme == "int4")           # the expert width, 32
    experts = model.sparse_mlp.experts
    assert isinstance(experts.gate_proj, QuantizedParam) and isinstance(experts.down_proj, QuantizedParam)
    assert experts.gate_proj.q.shape == ((2, 4, 32, 32) if scheme == "int4" else (2, 4, 64, 32))   # [L, E, D(/2), F]
    oracle = dequantised_oracle(hf_model, cfg)
    for ids in PROMPTS[1:]:
        ours, ref = run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(oracle, ids)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0, err_msg=f"{scheme}, prompt of {len(ids)}")
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_a_gguf_mixtures_experts_are_kept_quantized_and_compute_as_the_file_dequantised(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as Q

    from tests.conftest import MOE_VARIANTS
    from tests.models.test_moe_vs_transformers import write_moe_gguf

    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    model_type, overrides = MOE_VARIANTS["qwen3-moe"]
    hf_model = make_checkpoint(tmp_path / "hf", model_type, **overrides)
    write_moe_gguf(tmp_path / "moe.gguf", hf_model, experts_type=lambda name: Q.Q4_1 if "down" in name else Q.Q8_0)
    kept, hit = load_gguf(tmp_path / "moe.gguf")
    cfg = kept.config
    assert dict((k, (f, g, o)) for k, f, g, o in cfg.quantization) == {
        "experts.gate_proj": ("int8", 32, False), "experts.up_proj": ("int8", 32, False),
        "experts.down_proj": ("int4", 32, True)}                 # the rest of the file: F32
    assert kept.layers.mlp.experts.down_proj.q.shape == (2, 8, 16, 64)        # [L, E, F/2, D]
    plain, _ = load_model(tmp_path / "moe.gguf", quantization="none")
    for ids in PROMPTS[2:]:
        ours, ref = run_chunks(kept, cfg, ids, [len(ids)]), run_chunks(plain, plain.config, ids, [len(ids)])
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    again, hit = load_gguf(tmp_path / "moe.gguf")                             # from the converted cache
    assert hit and again.config == cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(kept))


def test_a_quantized_model_holds_a_fraction_of_the_f32_bytes(llama):
    folder, _ = llama
    sizes = {q: sum(x.nbytes for x in jax.tree.leaves(nnx.state(load_model(folder, quantization=q)[0])))
             for q in (None, "int8", "int4")}
    # tiny model: norms and the f16 scales of short groups weigh more than in a real one
    assert sizes["int8"] < 0.3 * sizes[None] and sizes["int4"] < 0.2 * sizes[None]


KEPT_TYPES = {"q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q8_0, "o_proj": Q.Q8_0, "gate_proj": Q.Q8_0,
              "up_proj": Q.Q4_1, "down_proj": Q.F16}


def kept_type(name: str, arr) -> Q:
    if "layers.1.mlp.gate_proj" in name:
        return Q.Q4_1                  # gate_proj: Q8_0 in layer 0, Q4_1 in layer 1 (int8 with offsets)
    return next((q for key, q in KEPT_TYPES.items() if key in name), Q.Q8_0 if "embed" in name else Q.F32)


def test_gguf_blocks_are_kept_quantized_and_compute_as_the_file_dequantised(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    hf_model = make_checkpoint(tmp_path / "hf", "llama", num_attention_heads=2, num_key_value_heads=1,
                               tie_word_embeddings=True)              # head size 32: o_proj's blocks fit a head
    write_gguf(tmp_path / "tiny.gguf", hf_model, kept_type)
    kept, hit = load_gguf(tmp_path / "tiny.gguf")
    cfg = kept.config
    assert not hit and dict((k, (b, g, o)) for k, b, g, o in cfg.quantization) == {
        "q_proj": ("int4", 32, True), "k_proj": ("int4", 32, True), "v_proj": ("int8", 32, False),
        "o_proj": ("int8", 32, False), "gate_proj": ("int8", 32, True), "up_proj": ("int4", 32, True),
        "embed_tokens": ("int8", 32, False)}    # down: F16
    plain, _ = load_model(tmp_path / "tiny.gguf", quantization="none")
    assert not plain.config.quantization
    for ids in PROMPTS:
        ours, ref = run_chunks(kept, cfg, ids, [len(ids)]), run_chunks(plain, plain.config, ids, [len(ids)])
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # the cache holds the repacked form: a second load reads no block and restores the same bytes
    monkeypatch.setattr("jaxengine.models.gguf.read_gguf", lambda *a: pytest.fail("converted again"))
    again, hit = load_gguf(tmp_path / "tiny.gguf")
    assert hit and again.config == cfg
    assert again.layers.self_attn.q_proj.q.dtype == np.uint8 and again.embed_tokens.q.dtype == np.int8
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(kept))
    assert (converted_cache_path(tmp_path / "tiny.gguf", "dequantized") / "weights" / "params").is_dir()


K_TYPES = {"q_proj": Q.Q4_K, "k_proj": Q.Q5_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K, "up_proj": Q.Q5_K,
           "down_proj": Q.Q6_K, "embed": Q.Q6_K}


def k_type(name: str, arr) -> Q:
    if "mlp.gate_proj" in name:
        return Q.Q4_K if "layers.0." in name else Q.Q6_K      # mixed: int8 values, groups of 16, offsets
    return next((q for key, q in K_TYPES.items() if key in name), Q.F32)


def test_gguf_k_quants_are_kept_quantized_and_compute_as_the_file_dequantised(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    # K-quants' super-blocks are of 256 weights: every contracted axis a multiple of 256
    hf_model = make_checkpoint(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                               num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    write_gguf(tmp_path / "k.gguf", hf_model, k_type)
    kept, _ = load_gguf(tmp_path / "k.gguf")
    cfg = kept.config
    assert dict((k, (f, g, o)) for k, f, g, o in cfg.quantization) == {
        "q_proj": ("int4-f32", 32, True), "k_proj": ("int8-f32", 32, True), "v_proj": ("int8-f32", 16, False),
        "o_proj": ("int4-f32", 32, True), "gate_proj": ("int8-f32", 16, True), "up_proj": ("int8-f32", 32, True),
        "down_proj": ("int8-f32", 16, False), "embed_tokens": ("int8-f32", 16, False)}
    plain, _ = load_model(tmp_path / "k.gguf", quantization="none")
    for ids in PROMPTS:
        ours, ref = run_chunks(kept, cfg, ids, [len(ids)]), run_chunks(plain, plain.config, ids, [len(ids)])
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert 0.1 < np.abs(ours).max() < 100                    # weights of a sensible size: logits neither 0 nor wild


def test_unsupported_quantization_requests_are_clear_errors(llama, tmp_path):
    folder, hf_model = llama
    with pytest.raises(ValueError, match=r"quantization: 'fp4' is not supported \(supported: \['fp8', 'int8', 'int4', 'none'\]\)"):
        load_model(folder, quantization="fp4")
    write_gguf(tmp_path / "tiny.gguf", hf_model)
    with pytest.raises(ValueError, match="quantization: 'int8' quantizes an unquantized checkpoint; a GGUF file"):
        load_model(tmp_path / "tiny.gguf", quantization="int8")
    with pytest.raises(ValueError, match="quantization: 'int3' is not supported"):
        online_plan(load_model(folder)[1], "int3")
