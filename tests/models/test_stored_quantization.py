"""Checkpoints stored quantized, served as stored (jaxengine/models/stored_quantization.py): FP8 block-wise,
per channel and per tensor written by hand with torch, compressed-tensors written with the
library, AWQ and GPTQ int4 packed by hand as their writers pack; each against transformers running
the same weights dequantised, and the errors that name a field or a tensor."""
import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxengine.models.quantization import QuantizedParam
from jaxengine.models.weights import load_model

from tests.conftest import make_checkpoint
from tests.models.test_llama_vs_transformers import PROMPTS, oracle_logits, run_chunks

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    return make_checkpoint(folder, "llama")                       # head size 16, MLP width 128


def linears(model):
    """(module name, weight [out, in]) of every projection of the layers."""
    return [(name, p.detach()) for name, p in model.named_parameters()
            if name.endswith(".weight") and name.split(".")[-2] in LINEARS]


def write(folder, hf_model, replaced: dict, quantization_config: dict):
    """The checkpoint with the projections' tensors replaced by ``replaced`` (module -> tensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(folder)
    tensors = {k: v.contiguous() for k, v in hf_model.state_dict().items()
               if k[:-len(".weight")] not in replaced}
    for module, parts in replaced.items():
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def with_weights(hf_model, dequantised: dict):
    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name[:-len(".weight")] in dequantised:
                p.copy_(dequantised[name[:-len(".weight")]])
    return ref


def assert_matches(folder, oracle, atol=1e-4):
    model, cfg = load_model(folder)
    assert isinstance(model.layers.mlp.down_proj, QuantizedParam)
    for ids in PROMPTS:
        ours, ref = run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(oracle, ids)
        np.testing.assert_allclose(ours, ref, atol=atol, rtol=0, err_msg=f"prompt of {len(ids)}")
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    return model, cfg


# ---------------------------------------------------------------- FP8
def fp8_blocks(w: torch.Tensor, block: tuple[int, int]):
    """w -> (float8 values, float32 scale per block [ceil(out/b0), ceil(in/b1)], dequantised)."""
    b0, b1 = block
    out, inner = w.shape
    rows, cols = -(-out // b0), -(-inner // b1)
    padded = torch.zeros(rows * b0, cols * b1)
    padded[:out, :inner] = w.abs()
    s = padded.reshape(rows, b0, cols, b1).amax(dim=(1, 3)) / 448
    full = s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inner]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, s, q.float() * full


def test_fp8_block_wise_as_deepseek_writes_it(llama, tmp_path):
    replaced, dequantised = {}, {}
    for name, w in linears(llama):
        q, s, back = fp8_blocks(w, (32, 32))              # o_proj's blocks span two heads of 16
        module = name[:-len(".weight")]
        replaced[module] = {"weight": q, "weight_scale_inv": s}
        dequantised[module] = back
    folder = write(tmp_path / "fp8", llama, replaced, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                       "fmt": "e4m3", "weight_block_size": [32, 32]})
    model, cfg = assert_matches(folder, with_weights(llama, dequantised), atol=1e-4)
    assert cfg.quant_spec("o_proj") == ("fp8", 16, False) and cfg.quant_spec("up_proj") == ("fp8", 32, False)
    assert model.layers.mlp.up_proj.q.dtype == jnp.float8_e4m3fn
    assert model.layers.mlp.up_proj.scale.shape == (2, 2, 128)       # [L, D / 32, F]
    assert cfg.quant_spec("embed_tokens") is None                    # stored plain, kept plain


def test_a_mixtures_fp8_experts_stored_one_by_one_are_kept_quantized_as_stacks(tmp_path):
    """Qwen3-MoE-FP8's layout: each expert's projections a tensor of their own with their block scales."""
    from tests.conftest import MOE_VARIANTS

    model_type, overrides = MOE_VARIANTS["qwen3-moe"]
    hf = make_checkpoint(tmp_path / "plain", model_type, **overrides)      # D 64, 8 experts 32 wide
    state, f = hf.state_dict(), overrides["moe_intermediate_size"]
    tensors = {k: v for k, v in state.items() if ".experts." not in k}
    oracle = copy.deepcopy(hf)
    fused = {name: p for name, p in oracle.named_parameters() if ".experts." in name}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]    # [E, 2F, D], [E, D, F]
        for e in range(gate_up.shape[0]):
            for proj, w, rows in (("gate_proj", gate_up[e, :f], slice(0, f)), ("up_proj", gate_up[e, f:], slice(f, 2 * f)),
                                  ("down_proj", down[e], None)):
                q, scale, back = fp8_blocks(w, (16, 32))
                tensors[f"{prefix}.{e}.{proj}.weight"], tensors[f"{prefix}.{e}.{proj}.weight_scale_inv"] = q, scale
                with torch.no_grad():
                    if rows is None:
                        fused[f"{prefix}.down_proj"][e].copy_(back)
                    else:
                        fused[f"{prefix}.gate_up_proj"][e, rows].copy_(back)
    folder = tmp_path / "fp8"
    folder.mkdir()
    hf.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
    (folder / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(folder)
    assert cfg.quant_spec("experts.gate_proj") == ("fp8", 32, False) and cfg.quant_spec("experts.down_proj") == ("fp8", 32, False)
    experts = model.layers.mlp.experts
    assert experts.gate_proj.q.dtype == jnp.float8_e4m3fn and experts.gate_proj.scale.shape == (2, 8, 2, 32)   # [L, E, D/32, F]
    for ids in PROMPTS[2:]:
        ours, ref = run_chunks(model, cfg, ids, [len(ids)]), oracle_logits(oracle, ids)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0, err_msg=f"prompt of {len(ids)}")
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_fp8_per_channel_and_per_tensor_with_static_activation_scales(llama, tmp_path):
    replaced, dequantised = {}, {}
    for name, w in linears(llama):
        module = name[:-len(".weight")]
        per_tensor = "mlp" in name
        q, s, back = fp8_blocks(w, w.shape if per_tensor else (1, w.shape[1]))
        replaced[module] = {"weight": q, "weight_scale_inv": s.reshape(()) if per_tensor else s.reshape(-1),
                            "input_scale": torch.tensor(0.5)}        # read and not used
        dequantised[module] = back
    folder = write(tmp_path / "fp8", llama, replaced, {"quant_method": "fp8", "activation_scheme": "static"})
    _, cfg = assert_matches(folder, with_weights(llama, dequantised), atol=1e-4)
    assert cfg.quant_spec("q_proj") == ("fp8", 64, False) and cfg.quant_spec("down_proj") == ("fp8", 128, False)


# ---------------------------------------------------------------- compressed-tensors
CT_SCHEMES = {
    "int4-asym-group": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    "int4-sym-group": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    "int8-channel": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "fp8-block": dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32]),
}


def compressed_tensors_checkpoint(hf_model, folder, weights: dict):
    """llm-compressor's way: the scheme applied with the library, scales and zero points from
    each weight's range (the library's own ``calculate_qparams``), compressed and saved; the
    oracle holds the library's decompression of the same tensors."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(hf_model)
    args = QuantizationArgs(**weights)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                if args.strategy == "group":
                    g = w.reshape(w.shape[0], -1, args.group_size)
                    low, high = g.amin(-1), g.amax(-1)
                elif args.strategy == "block":
                    b0, b1 = args.block_structure
                    g = w.reshape(w.shape[0] // b0, b0, w.shape[1] // b1, b1)
                    low, high = g.amin((1, 3)), g.amax((1, 3))
                else:
                    low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
                scale, zero = calculate_qparams(low, high, args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    compressor.decompress_model(model)
    dequantised = {name: module.weight.detach().float() for name, module in model.named_modules()
                   if name.split(".")[-1] in LINEARS}
    return with_weights(hf_model, dequantised)


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_as_the_library_writes_it(llama, tmp_path, scheme):
    oracle = compressed_tensors_checkpoint(llama, tmp_path / scheme, CT_SCHEMES[scheme])
    _, cfg = assert_matches(tmp_path / scheme, oracle, atol=1e-4)
    fmt = {"int4": "int4-f32", "int8": "int8-f32", "fp8-": "fp8"}[scheme[:4]]
    group = {"int4-asym-group": 16, "int4-sym-group": 32, "int8-channel": 64, "fp8-block": 32}[scheme]
    assert cfg.quant_spec("up_proj") == (fmt, group, fmt == "int4-f32")
    assert cfg.quant_spec("lm_head") is None                                     # in the ignore list


# ---------------------------------------------------------------- AWQ and GPTQ, packed by hand
def int4_groups(w: torch.Tensor, group: int):
    """w [out, in] -> (values 0..15, zero points 0..15, scales [out, in / group], dequantised)."""
    g = w.reshape(w.shape[0], -1, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).to(torch.float16).float()
    zero = torch.round(-low / scale).clamp(0, 15)
    values = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    back = ((values - zero[..., None]) * scale[..., None]).reshape(w.shape)
    return values.reshape(w.shape).int(), zero.int(), scale, back


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def test_awq_gemm_as_autoawq_packs_it(llama, tmp_path):
    replaced, dequantised = {}, {}
    for name, w in linears(llama):
        values, zero, scale, back = int4_groups(w, 32)
        order = (0, 2, 4, 6, 1, 3, 5, 7)                  # AutoAWQ's order of 8 columns in a word
        replaced[name[:-len(".weight")]] = {
            "qweight": to_int32(pack_words(values.T, order)), "qzeros": to_int32(pack_words(zero.T, order)),
            "scales": scale.T.to(torch.float16)}
        dequantised[name[:-len(".weight")]] = back
    folder = write(tmp_path / "awq", llama, replaced, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                       "zero_point": True, "version": "gemm"})
    _, cfg = assert_matches(folder, with_weights(llama, dequantised))
    assert cfg.quant_spec("gate_proj") == ("int4-f32", 32, True) and cfg.quant_spec("o_proj") == ("int4-f32", 16, True)


def pack_words(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, cols] 0..15 -> uint32 words [rows, cols / 8] (as int64): nibble i of word c holds
    column 8c + order[i]."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= values[:, col::8].long() << (4 * i)
    return out


@pytest.mark.parametrize("form", ["gptq", "gptq_v2"])
def test_gptq_as_autogptq_packs_it(llama, tmp_path, form):
    replaced, dequantised = {}, {}
    for name, w in linears(llama):
        values, zero, scale, back = int4_groups(w, 32)
        stored_zero = zero - 1 if form == "gptq" else zero        # v1 stores each zero point less one
        assert stored_zero.min() >= 0                              # (a zero point of 0 has no v1 form)
        module = name[:-len(".weight")]
        inner = w.shape[1]
        replaced[module] = {
            "qweight": to_int32(pack_words(values).T),            # [in / 8, out]: 8 input rows a word
            "qzeros": to_int32(pack_words(stored_zero.T)), "scales": scale.T.to(torch.float16),
            "g_idx": torch.arange(inner, dtype=torch.int32) // 32, "bias": torch.zeros(w.shape[0])}
        dequantised[module] = back
    folder = write(tmp_path / form, llama, replaced, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                      "desc_act": False, "sym": False, "checkpoint_format": form})
    assert_matches(folder, with_weights(llama, dequantised))


# ---------------------------------------------------------------- errors
def test_what_cannot_be_served_is_an_error_naming_the_field_or_the_tensor(llama, tmp_path):
    def checkpoint(config, change=lambda parts: parts):
        replaced = {}
        for name, w in linears(llama):
            q, s, _ = fp8_blocks(w, (32, 32))
            replaced[name[:-len(".weight")]] = change({"weight": q, "weight_scale_inv": s})
        return write(tmp_path / str(len(list(tmp_path.iterdir()))), llama, replaced, config)

    fp8 = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    with pytest.raises(ValueError, match=r"quantization_config.quant_method: 'bitsandbytes' is not supported "
                                         r"\(supported: \['fp8', 'compressed-tensors', 'awq', 'gptq'\]\)"):
        load_model(checkpoint({"quant_method": "bitsandbytes"}))
    with pytest.raises(ValueError, match=r"quantization_config.activation_scheme: 'tensorwise' is not supported"):
        load_model(checkpoint({**fp8, "activation_scheme": "tensorwise"}))
    with pytest.raises(ValueError, match=r"quantization_config.bits: 3 is not supported \(supported: \[4\]\)"):
        load_model(checkpoint({"quant_method": "awq", "bits": 3}))
    bad = checkpoint(fp8, lambda p: {**p, "weight_scale_inv": p["weight_scale_inv"][:1]})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d\.\w+\.\w+_proj\.weight: its scale has shape \(1, \d\)"):
        load_model(bad)
    wrong = checkpoint(fp8, lambda p: {**p, "weight": p["weight"].float()})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d\.\w+\.\w+_proj\.weight: dtype float32, "
                                         r"float8_e4m3fn expected"):
        load_model(wrong)
    with pytest.raises(ValueError, match=r"quantization: 'int8' quantizes an unquantized checkpoint; .* is stored "
                                         r"quantized \(quantization_config.quant_method 'fp8'\)"):
        load_model(checkpoint(fp8), quantization="int8")


def test_a_checkpoint_stored_quantized_dequantises_with_none(llama, tmp_path):
    replaced, dequantised = {}, {}
    for name, w in linears(llama):
        q, s, back = fp8_blocks(w, (32, 32))
        replaced[name[:-len(".weight")]] = {"weight": q, "weight_scale_inv": s}
        dequantised[name[:-len(".weight")]] = back
    folder = write(tmp_path / "fp8", llama, replaced, {"quant_method": "fp8", "weight_block_size": [32, 32]})
    model, cfg = load_model(folder, quantization="none")
    assert not cfg.quantization and not isinstance(model.layers.mlp.down_proj, QuantizedParam)
    oracle = with_weights(llama, dequantised)
    ours, ref = run_chunks(model, cfg, PROMPTS[2], [len(PROMPTS[2])]), oracle_logits(oracle, PROMPTS[2])
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
