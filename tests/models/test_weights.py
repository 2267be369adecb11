"""Checkpoint loading: sharded safetensors, clear errors, GGUF (written here with the gguf package)."""
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from flax import nnx
from gguf import quants

from jaxengine.models.gguf import load_gguf, read_gguf, unpermute_rope_rows
from jaxengine.models.registry import get_model_class
from jaxengine.paths import converted_cache_path
from jaxengine.models.weights import build_model, load_model, read_safetensors_folder

from tests.conftest import make_checkpoint
from tests.models.test_llama_vs_transformers import PROMPTS, oracle_logits, run_chunks


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, make_checkpoint(folder, "llama")


def test_sharded_safetensors_with_an_index_load(tmp_path, llama):
    _, hf_model = llama
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    model, cfg = load_model(tmp_path)
    np.testing.assert_allclose(run_chunks(model, cfg, PROMPTS[2], [len(PROMPTS[2])]),
                               oracle_logits(hf_model, PROMPTS[2]), atol=1e-4, rtol=0)


def test_missing_unexpected_and_misshapen_tensors_are_named(llama):
    folder, _ = llama
    cfg, tensors = read_safetensors_folder(folder)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.1\.mlp\.up_proj'\]; unexpected tensors \[\]"):
        build_model(cfg, missing)
    extra = {**tensors, "model.layers.0.self_attn.rotary.weight": np.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.rotary\.weight'\]"):
        build_model(cfg, extra)
    bad = {**tensors, "model.norm.weight": np.zeros(65, np.float32)}
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight: shape \(65,\) in the checkpoint, \(64,\) expected"):
        build_model(cfg, bad)


def test_unknown_architecture_and_missing_config_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: DeepseekV3ForCausalLM, GptOssForCausalLM, "
                                         "LlamaForCausalLM, "
                                         "MistralForCausalLM, MixtralForCausalLM, NemotronHForCausalLM, Qwen2ForCausalLM, "
                                         "Qwen2MoeForCausalLM, "
                                         "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM$"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# K-quants, which the gguf package reads and does not write: random super-blocks with their d
# (and dmin) set so the weights are of the size of a model's -> (d, dmin, bytes of d, of dmin)
K_QUANTS = {Q.Q4_K: (2e-4, 1.5e-3, slice(0, 2), slice(2, 4)), Q.Q5_K: (1e-4, 1.5e-3, slice(0, 2), slice(2, 4)),
            Q.Q6_K: (3e-5, None, slice(208, 210), None)}


def k_quant_blocks(shape, qtype, seed=0):
    from gguf.constants import GGML_QUANT_SIZES

    per_block, size = GGML_QUANT_SIZES[qtype]
    d, dmin, d_at, dmin_at = K_QUANTS[qtype]
    blocks = np.random.default_rng(seed).integers(0, 256, (shape[0] * shape[1] // per_block, size), np.uint8)
    blocks[:, d_at] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if dmin_at is not None:
        blocks[:, dmin_at] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
    return blocks.reshape(shape[0], -1)


def write_gguf(path, hf_model, qtype_of=lambda name, w: Q.F32):
    """What llama.cpp's converter writes for a Llama checkpoint: metadata, permuted Q/K rows."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    expected = {}
    for name, tensor in hf_model.state_dict().items():
        arr = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            arr = permute_like_llama_cpp(arr, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = permute_like_llama_cpp(arr, c.num_key_value_heads)
        qtype = qtype_of(name, arr)
        data = arr if qtype == Q.F32 else k_quant_blocks(arr.shape, qtype) if qtype in K_QUANTS else \
            quants.quantize(arr, qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if qtype == Q.F32 else qtype)
        roundtrip = arr if qtype == Q.F32 else quants.dequantize(data, qtype).reshape(arr.shape)
        if name.endswith("q_proj.weight"):
            roundtrip = unpermute_rope_rows(roundtrip, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            roundtrip = unpermute_rope_rows(roundtrip, c.num_key_value_heads)
        expected[name] = roundtrip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_f32_gguf_with_permuted_qk_rows_gives_the_same_logits_as_transformers(tmp_path, llama):
    _, hf_model = llama
    write_gguf(tmp_path / "tiny.gguf", hf_model)
    cfg, tensors = read_gguf(tmp_path / "tiny.gguf")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 256)
    for name, ref in hf_model.state_dict().items():
        np.testing.assert_array_equal(tensors[name], ref.numpy(), err_msg=name)
    model = build_model(cfg, tensors)
    np.testing.assert_allclose(run_chunks(model, cfg, PROMPTS[3], [len(PROMPTS[3])]),
                               oracle_logits(hf_model, PROMPTS[3]), atol=1e-4, rtol=0)


QTYPES = {"q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q8_0, "o_proj": Q.F16, "gate_proj": Q.Q8_0}


def test_quantized_gguf_tensors_dequantise_in_place(tmp_path, llama):
    _, hf_model = llama

    def qtype_of(name, arr):
        return next((q for key, q in QTYPES.items() if key in name), Q.F32)

    expected = write_gguf(tmp_path / "q.gguf", hf_model, qtype_of)
    _, tensors = read_gguf(tmp_path / "q.gguf")
    for name, ref in expected.items():
        np.testing.assert_array_equal(tensors[name], ref, err_msg=name)
    scale = float(np.abs(hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()).max())
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(q - hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()).max() < 0.2 * scale


def test_converted_weights_cache_skips_dequantisation_on_the_second_load(tmp_path, llama, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    _, hf_model = llama
    write_gguf(tmp_path / "tiny.gguf", hf_model, lambda n, a: Q.Q8_0 if "mlp" in n else Q.F32)
    cfg, tensors = read_gguf(tmp_path / "tiny.gguf")
    model1, hit1 = load_gguf(tmp_path / "tiny.gguf", keep_quantized=False)
    cached = converted_cache_path(tmp_path / "tiny.gguf", "dequantized")
    assert sorted(p.name for p in cached.iterdir()) == ["weights"]
    assert sorted(p.name for p in (cached / "weights").iterdir()) == ["config.json", "params"]
    monkeypatch.setattr("jaxengine.models.gguf.read_gguf", lambda *a: pytest.fail("dequantised again"))
    model2, hit2 = load_gguf(tmp_path / "tiny.gguf", keep_quantized=False)
    assert (hit1, hit2) == (False, True) and model1.config == model2.config == cfg
    reference = nnx.state(build_model(cfg, tensors))
    for state in (nnx.state(model1), nnx.state(model2)):
        jax.tree.map(np.testing.assert_array_equal, state, reference)


def test_a_cache_folder_of_the_earlier_format_is_rebuilt(tmp_path, llama, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf", llama[1])
    cached = converted_cache_path(tmp_path / "tiny.gguf")
    (cached / "params").mkdir(parents=True)                  # the earlier layout's files
    (cached / "params" / "x").write_bytes(b"")
    (cached / "config.json").write_text("{}")
    (cached / "model.safetensors").write_bytes(b"")
    (cached / "weights").mkdir()                             # a copy of an earlier format
    (cached / "weights" / "config.json").write_text("{}")
    _, hit = load_gguf(tmp_path / "tiny.gguf")
    assert not hit and sorted(p.name for p in cached.iterdir()) == ["weights"]
    assert sorted(p.name for p in (cached / "weights").iterdir()) == ["config.json", "params"]
    _, hit = load_gguf(tmp_path / "tiny.gguf")
    assert hit


def test_bf16_params(llama):
    folder, hf_model = llama
    model, cfg = load_model(folder, dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    ours = run_chunks(model, cfg, PROMPTS[2], [len(PROMPTS[2])])
    ref = oracle_logits(hf_model, PROMPTS[2])
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_the_jitted_step_donates_the_kv_cache(llama):
    from jaxengine.kernels.paged_attention import AttentionMetadata
    from jaxengine.models.forward import make_forward
    from jaxengine.models.llama import init_kv_caches

    model, cfg = load_model(llama[0])
    state, forward = make_forward(model)
    caches = init_kv_caches(cfg, 8, 4)
    md = AttentionMetadata.build([(0, 3, [1])], 4, num_tokens=4, max_blocks=2)
    new_caches, _ = forward(state, caches, jnp.asarray([1, 2, 3, 0]), md, jnp.asarray([2]))
    assert all(c.is_deleted() for c in caches)                            # reused in place, not copied
    k0 = np.asarray(new_caches[0][0])                                     # layer 0 of k: [P, S, K*H]
    assert k0[1, :3].any() and not k0[1, 3:].any() and not k0[2:].any()   # 3 rows in block 1, nothing else


@pytest.mark.parametrize("kernels, layout", [("pallas", "gqa")])
def test_the_compiled_step_never_copies_the_kv_cache(kernels, layout):
    """With the Pallas attention and KV write kernels, as the CPU interprets them: the caches ride
    the layer scan's carry and are written in place, with no copy of a cache-sized array, and the
    donated caches alias the outputs. (Compiled under the suite's flags; every program the engine
    runs is read under its own flags in ``tests/runner/test_compiled_programs.py``.)"""
    from flax import nnx

    from jaxengine.kernels.paged_attention import AttentionMetadata
    from jaxengine.kernels.paged_attention.backend import select_attention
    from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.forward import make_forward
    from jaxengine.models.llama import LlamaForCausalLM, init_kv_caches

    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16)
    if layout == "one KV head":
        cfg = cfg.replace(num_kv_heads=1, head_dim=32)
    elif layout == "latent":
        cfg = ModelConfig("DeepseekV3ForCausalLM", 256, 64, 128, 2, 4, 4, 16, kv_lora_rank=16, qk_nope_head_dim=16,
                          v_head_dim=16)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), attention_fn=select_attention(kernels))
    if kernels == "pallas":
        model.layers.self_attn.kv_write_fn = write_kv_pallas
    state, forward = make_forward(model)
    caches = init_kv_caches(cfg, 64, 16)                  # [2 layers, 64 blocks, 16, 32 = heads x head size]
    assert [c.shape for c in caches] == [(2, 64, 16, 32)] * len(cfg.kv_cache_parts)
    md = AttentionMetadata.build([(0, 3, [1]), (20, 1, [2, 3])], 16, num_tokens=16, max_blocks=4)
    hlo = forward.lower(state, caches, jnp.zeros(16, jnp.int32), md, jnp.asarray([2, 3])).compile().as_text()
    heads = ",".join(map(str, cfg.kv_cache_parts[0]))
    cache_shapes = ("[2,64,16,32]", "[128,16,32]", f"[128,16,{heads}]", f"[2,64,16,{heads}]", f"[2048,{heads}]")
    copies = [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in cache_shapes)]
    assert copies == []
    header = hlo.splitlines()[0]
    aliased = dict(re.findall(r"\{(\d+)\}: \((\d+), \{\}", header))          # output -> parameter
    params = re.search(r"entry_computation_layout=\{\((.*?)\)->", header).group(1)
    shapes = re.findall(r"(?:\w+\[[\d,]*\])", re.sub(r"/\*index=\d+\*/", "", params))
    parts = len(cfg.kv_cache_parts)
    assert [shapes[int(aliased[str(out)])] for out in range(parts)] == ["f32[2,64,16,32]"] * parts   # in place


def test_a_bfloat16_checkpoint_loads_sharded_with_its_exact_values(tmp_path, llama):
    """Most checkpoints are stored in bfloat16, which numpy cannot read by itself."""
    import torch

    from jaxengine.models.mesh import make_mesh

    _, hf_model = llama
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    hf_model.to(torch.float32)
    model, _ = load_model(tmp_path, dtype=jnp.float32, mesh=make_mesh(jax.devices()[:2]))
    want = hf_model.model.layers[1].self_attn.q_proj.weight.detach().to(torch.bfloat16).float().numpy()
    got = np.asarray(model.layers.self_attn.q_proj[...][1]).reshape(want.shape[1], -1).T
    np.testing.assert_array_equal(got, want)
    assert model.layers.self_attn.q_proj[...].sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None)
