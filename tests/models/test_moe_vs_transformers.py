"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) against transformers, and their checkpoints:
per-expert or stacked tensors, and the errors of a bad one."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.forward import make_forward
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.moe import expert_counts, route
from jaxengine.models.weights import load_model
from tests.conftest import MOE_VARIANTS
from tests.models.test_llama_vs_transformers import BLOCK, PROMPTS, oracle_logits, run_chunks


def test_full_sequence_logits_match_transformers(moe_checkpoint):
    name, folder, hf_model = moe_checkpoint
    model, cfg = load_model(folder)
    assert cfg.is_moe
    for ids in PROMPTS:
        ours = run_chunks(model, cfg, ids, [len(ids)])
        ref = oracle_logits(hf_model, ids)
        assert ref.std() > 0.5, "logits too flat to compare argmax"
        np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0, err_msg=f"{name}, prompt of {len(ids)}")
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_the_tiny_models_route_each_prompt_over_several_experts(moe_checkpoint):
    # otherwise a mix-up of experts could not show in the logits
    _, folder, _ = moe_checkpoint
    model, cfg = load_model(folder)
    layer = cfg.sparse_layers[0]
    block = model.layers.mlp if not cfg.dense_layers else model.sparse_mlp
    x = model.embed_tokens[...][jnp.asarray(PROMPTS[3])]
    _, experts = route(x @ block.router[...][0], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    counts = np.asarray(expert_counts(experts, cfg.num_experts, len(PROMPTS[3])))
    assert layer in cfg.sparse_layers and counts.sum() == len(PROMPTS[3]) * cfg.num_experts_per_tok
    assert (counts > 0).sum() == cfg.num_experts, counts


def test_chunked_prefill_and_a_padded_ragged_batch_equal_one_pass(moe_checkpoint):
    _, folder, hf_model = moe_checkpoint
    model, cfg = load_model(folder)
    ids = PROMPTS[3]
    np.testing.assert_allclose(run_chunks(model, cfg, ids, [3, 16, 1, 25]), run_chunks(model, cfg, ids, [len(ids)]),
                               atol=1e-4, rtol=0)
    state, forward = make_forward(model)
    a, b = PROMPTS[1], PROMPTS[2]
    md = AttentionMetadata.build([(0, len(a), [3, 4]), (0, len(b), [7, 8, 9, 10, 11, 12])], BLOCK,
                                 num_tokens=64, max_blocks=16, num_rows=4)
    last = jnp.asarray([len(a) - 1, len(a) + len(b) - 1])
    _, logits = forward(state, init_kv_caches(cfg, 32, BLOCK), jnp.asarray(a + b + [0] * (64 - len(a) - len(b))),
                        md, last)
    np.testing.assert_allclose(np.asarray(logits[0]), oracle_logits(hf_model, a)[-1], atol=2e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1]), oracle_logits(hf_model, b)[-1], atol=2e-4, rtol=0)


def _copy_checkpoint(folder, to, edit):
    """``folder``'s checkpoint with its tensors passed through ``edit`` (name -> array dict)."""
    to.mkdir()
    (to / "config.json").write_text((folder / "config.json").read_text())
    save_file(edit(load_file(folder / "model.safetensors")), to / "model.safetensors")
    return to


def _fused(tensors):
    """Per-expert tensors -> the stacked, fused form transformers 5 holds: gate_up [E, 2F, D], down [E, D, F]."""
    out, experts = {}, {}
    for name, w in tensors.items():
        parts = name.split(".")
        if ".experts." in name:
            prefix, e, proj = ".".join(parts[:parts.index("experts") + 1]), int(parts[-3]), parts[-2]
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = w
        else:
            out[name] = w
    for prefix, projs in experts.items():
        stack = {p: np.stack([ws[e] for e in sorted(ws)]) for p, ws in projs.items()}
        out[prefix + ".gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        out[prefix + ".down_proj"] = stack["down_proj"]
    return out


def test_stacked_fused_expert_tensors_load_as_the_per_expert_ones(tmp_path, checkpoints_qwen3_moe):
    folder, hf_model = checkpoints_qwen3_moe
    fused = _copy_checkpoint(folder, tmp_path / "fused", _fused)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))
    model, cfg = load_model(fused)
    ids = PROMPTS[2]
    np.testing.assert_allclose(run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(hf_model, ids), atol=2e-4, rtol=0)


@pytest.fixture(scope="module")
def checkpoints_qwen3_moe(tmp_path_factory):
    from tests.conftest import MOE_VARIANTS, make_checkpoint

    model_type, overrides = MOE_VARIANTS["qwen3-moe"]
    folder = tmp_path_factory.mktemp("qwen3-moe-files")
    return folder, make_checkpoint(folder, model_type, **overrides)


def test_a_missing_expert_tensor_is_an_error_naming_it(tmp_path, checkpoints_qwen3_moe):
    folder, _ = checkpoints_qwen3_moe
    bad = _copy_checkpoint(folder, tmp_path / "bad", lambda t: {k: v for k, v in t.items()
                                                               if k != "model.layers.1.mlp.experts.5.up_proj.weight"})
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'\]"):
        load_model(bad)


def test_more_experts_than_the_config_says_is_an_error_naming_the_tensor(tmp_path, checkpoints_qwen3_moe):
    folder, _ = checkpoints_qwen3_moe
    bad = _copy_checkpoint(folder, tmp_path / "bad", lambda t: t)
    config = json.loads((bad / "config.json").read_text())
    config["num_local_experts" if "num_local_experts" in config else "num_experts"] = 6
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.experts\.6\.\w+_proj\.weight: expert 6, but "
                                         r"the config has 6 experts"):
        load_model(bad)


def test_a_fused_expert_tensor_of_the_wrong_expert_count_is_an_error(tmp_path, checkpoints_qwen3_moe):
    folder, _ = checkpoints_qwen3_moe
    bad = _copy_checkpoint(folder, tmp_path / "bad", lambda t: {
        k: (v[:7] if k == "model.layers.0.mlp.experts.down_proj" else v) for k, v in _fused(t).items()})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.experts\.down_proj: shape \(7, 64, 32\) in "
                                         r"the checkpoint, \(8, 64, 32\) expected"):
        load_model(bad)


def test_parameter_counts_match_transformers_and_the_active_ones_leave_out_unchosen_experts(moe_checkpoint):
    _, folder, hf_model = moe_checkpoint
    _, cfg = load_model(folder)
    assert cfg.num_params == sum(p.numel() for p in hf_model.parameters())
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    expert += 2 * cfg.moe_intermediate_size + cfg.hidden_size if cfg.expert_bias else 0     # gpt-oss's biases
    unchosen = (cfg.num_experts - cfg.num_experts_per_tok) * expert
    assert cfg.num_active_params == cfg.num_params - len(cfg.sparse_layers) * unchosen
    assert cfg.routed_pairs_per_token == cfg.num_experts_per_tok * len(cfg.sparse_layers)


GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{g}.{k}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for k in ("weight", "bias")},
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
}


def write_moe_gguf(path, hf_model, per_expert: bool = False, experts_type=None):
    """What llama.cpp's converter writes for a mixture of experts: metadata, the experts stacked per
    layer as [E, out, in] (gpt-oss's de-interleaved, with their biases; ``per_expert``: one tensor
    per expert, as older Mixtral files), a llama file's Q/K rows permuted. ``experts_type(name)``:
    the GGUF type of a stacked experts tensor (default F32)."""
    import gguf
    from gguf import quants

    def add_experts(name, value):
        qtype = experts_type(name) if experts_type else gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            return w.add_tensor(name, value)
        w.add_tensor(name, quants.quantize(value, qtype), raw_dtype=qtype)

    from tests.models.test_weights import permute_like_llama_cpp

    c = hf_model.config
    arch = GGUF_ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    if arch != "llama":                 # Mixtral's experts are its intermediate_size wide
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
    w.add_expert_count(c.num_local_experts if hasattr(c, "num_local_experts") else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "gpt-oss":
        w.add_sliding_window(c.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(c.rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {**_GGUF_LAYER_NAMES, **({"post_attention_layernorm.weight": "post_attention_norm.weight"}
                                           if arch == "gpt-oss" else {})}
    for name, tensor in hf_model.state_dict().items():      # transformers 5 holds experts stacked, fused
        arr = tensor.numpy().astype(np.float32)
        if name in names:
            w.add_tensor(names[name], arr)
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":
            # [E, 2F, D] gate then up; gpt-oss: [E, D, 2F] interleaved column by column
            gate, up = ((arr[..., 0::2].transpose(0, 2, 1), arr[..., 1::2].transpose(0, 2, 1)) if arch == "gpt-oss"
                        else np.split(arr, 2, axis=1))
            for proj, value in (("gate", gate), ("up", up)):
                if per_expert:
                    for e in range(value.shape[0]):
                        w.add_tensor(f"{blk}.ffn_{proj}.{e}.weight", np.ascontiguousarray(value[e]))
                else:
                    add_experts(f"{blk}.ffn_{proj}_exps.weight", np.ascontiguousarray(value))
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(arr[:, 0::2]))
            w.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(arr[:, 1::2]))
        elif rest == "mlp.experts.down_proj":                # [E, D, F]; gpt-oss [E, F, D]
            down = np.ascontiguousarray(arr.transpose(0, 2, 1) if arch == "gpt-oss" else arr)
            if per_expert:
                for e in range(down.shape[0]):
                    w.add_tensor(f"{blk}.ffn_down.{e}.weight", np.ascontiguousarray(down[e]))
            else:
                add_experts(f"{blk}.ffn_down_exps.weight", down)
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"{blk}.ffn_down_exps.bias", arr)
        else:
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                arr = permute_like_llama_cpp(arr, c.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                arr = permute_like_llama_cpp(arr, c.num_key_value_heads)
            elif rest == "mlp.shared_expert_gate.weight":
                arr = arr.reshape(-1)
            w.add_tensor(f"{blk}.{layer_names[rest]}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_qwen3_moe_gguf_gives_the_logits_of_transformers(tmp_path, checkpoints_qwen3_moe, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))        # the converted-weights cache
    folder, hf_model = checkpoints_qwen3_moe
    write_moe_gguf(tmp_path / "tiny-moe.gguf", hf_model)
    model, cfg = load_model(tmp_path / "tiny-moe.gguf")
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "Qwen3MoeForCausalLM", 8, 3, 32)
    ids = PROMPTS[3]
    np.testing.assert_allclose(run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(hf_model, ids), atol=2e-4, rtol=0)
    again, _ = load_model(tmp_path / "tiny-moe.gguf")                       # now from the converted cache
    np.testing.assert_allclose(run_chunks(again, cfg, ids, [len(ids)]), oracle_logits(hf_model, ids), atol=2e-4, rtol=0)


GGUF_MOE = {   # llama.cpp can hold these: every layer sparse, gpt-oss's SwiGLU limit its fixed 7
    "mixtral-per-expert": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), True, "MixtralForCausalLM"),
    "qwen2-moe-shared": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48), False, "Qwen2MoeForCausalLM"),
    "gpt-oss": ("gpt_oss", {**MOE_VARIANTS["gpt-oss"][1], "swiglu_limit": 7.0}, False, "GptOssForCausalLM"),
}


@pytest.mark.parametrize("variant", sorted(GGUF_MOE))
def test_mixtral_qwen2_moe_and_gpt_oss_ggufs_give_the_logits_of_transformers(tmp_path, variant, monkeypatch):
    from tests.conftest import make_checkpoint

    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    model_type, overrides, per_expert, architecture = GGUF_MOE[variant]
    hf_model = make_checkpoint(tmp_path / "hf", model_type, **overrides)
    write_moe_gguf(tmp_path / "moe.gguf", hf_model, per_expert=per_expert)
    model, cfg = load_model(tmp_path / "moe.gguf")
    assert cfg.architecture == architecture and cfg.is_moe
    ids = PROMPTS[3]
    np.testing.assert_allclose(run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(hf_model, ids), atol=2e-4, rtol=0)


@pytest.fixture(scope="module")
def checkpoints_gpt_oss(tmp_path_factory):
    from tests.conftest import MOE_VARIANTS, make_checkpoint

    model_type, overrides = MOE_VARIANTS["gpt-oss"]
    folder = tmp_path_factory.mktemp("gpt-oss-files")
    return folder, make_checkpoint(folder, model_type, **overrides)


def test_a_gpt_oss_checkpoint_without_its_sinks_or_with_a_narrow_gate_up_is_an_error_naming_the_tensor(
        tmp_path, checkpoints_gpt_oss):
    folder, _ = checkpoints_gpt_oss
    bad = _copy_checkpoint(folder, tmp_path / "no-sinks", lambda t: {
        k: v for k, v in t.items() if k != "model.layers.2.self_attn.sinks"})
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.2\.self_attn\.sinks'\]"):
        load_model(bad)
    bad = _copy_checkpoint(folder, tmp_path / "narrow", lambda t: {
        k: (v[..., :-2] if k == "model.layers.1.mlp.experts.gate_up_proj" else v) for k, v in t.items()})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.experts\.gate_up_proj \(its gate half, seen as "
                                         r"model\.layers\.1\.mlp\.experts\.gate_proj\): shape \(4, 47, 64\)"):
        load_model(bad)


def test_a_quantized_checkpoint_is_an_error_naming_its_quantization_config(tmp_path, checkpoints_gpt_oss):
    folder, _ = checkpoints_gpt_oss
    quantized = _copy_checkpoint(folder, tmp_path / "mxfp4", lambda t: t)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config.quant_method: .mxfp4. is not supported \(supported: \[.fp8., .compressed-tensors., .awq., .gptq.\]\)"):
        load_model(quantized)
