"""LoRA adapters: PEFT checkpoints read into slots (against peft's own layers), the grouped
delta against its per-row reference, and clear errors for bad adapters."""
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.models.config import ModelConfig
from jaxengine.models.lora import load_adapter, lora_delta_reference
from jaxengine.models.lora_weights import lora_delta, lora_rows

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """A PEFT adapter of rank 4 on q_proj, v_proj and down_proj of a tiny Llama, B non-zero."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = get_peft_model(AutoModelForCausalLM.from_config(hf_config), LoraConfig(
        r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    return folder, model


def peft_delta(model, layer: int, module: str, x: np.ndarray) -> np.ndarray:
    import torch

    block = model.base_model.model.model.layers[layer]
    proj = getattr(block.self_attn if module != "down_proj" else block.mlp, module)
    with torch.no_grad():
        out = proj.lora_B["default"](proj.lora_A["default"](torch.from_numpy(x))) * proj.scaling["default"]
    return out.numpy()


def test_an_adapter_reads_into_padded_slots_as_peft_computes_it(peft_adapter):
    folder, model = peft_adapter
    adapter = load_adapter(folder, CONFIG, max_rank=8)
    assert adapter.config.target_modules == ("q_proj", "v_proj", "down_proj") and adapter.config.scale == 3.0
    assert adapter.weights["q_proj"][0].shape == (2, 32, 8) and adapter.weights["down_proj"][1].shape == (2, 8, 32)
    rng = np.random.default_rng(0)
    for module, d_in in (("q_proj", 32), ("v_proj", 32), ("down_proj", 48)):
        a, b = adapter.weights[module]
        assert not a[:, :, 4:].any() and not b[:, 4:, :].any()          # the padded rank is zero
        for layer in range(2):
            x = rng.standard_normal((5, d_in)).astype(np.float32)
            np.testing.assert_allclose(x @ a[layer] @ b[layer], peft_delta(model, layer, module, x), atol=1e-5)
    assert len(adapter.digest) == 64 and load_adapter(folder, CONFIG, max_rank=4).digest == adapter.digest


def test_a_bfloat16_adapter_reads_as_its_float32_values(peft_adapter, tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file
    from safetensors.flax import save_file

    folder, _ = peft_adapter
    (tmp_path / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, str(tmp_path / "adapter_model.safetensors"))
    got = load_adapter(tmp_path, CONFIG, max_rank=4).weights["q_proj"][0]
    name = next(k for k in tensors if "layers.1.self_attn.q_proj.lora_A" in k)
    np.testing.assert_array_equal(got[1], tensors[name].astype(np.float32).T)


@pytest.mark.parametrize("grouped", ["openblas", "ragged_dot"])
def test_the_grouped_deltas_equal_each_rows_own_adapter(grouped):
    """Two modules sharing an input (one shrink for both, side by side), three slots."""
    from jaxengine.kernels.matmul import grouped_dense, xla_grouped_dense

    fn = grouped_dense if grouped == "openblas" else xla_grouped_dense
    rng = np.random.default_rng(1)
    a1, a2 = (jnp.asarray(rng.standard_normal((3, 16, 4)), jnp.float32) for _ in range(2))
    b1, b2 = jnp.asarray(rng.standard_normal((3, 4, 24)), jnp.float32), jnp.asarray(rng.standard_normal((3, 4, 8)),
                                                                                     jnp.float32)
    x = jnp.asarray(rng.standard_normal((13, 16)), jnp.float32)
    slots = np.asarray([2, -1, 0, 2, 1, -1, 0, 0, 2, -1, 1], np.int32)      # interleaved, base rows among them
    order, sizes, inverse = lora_rows(slots, 3, 13)                           # two padding tokens after them
    assert sizes.tolist() == [3, 2, 3] and order[8:].tolist() == [1, 5, 9, 11, 12]
    assert (order[inverse] == np.arange(13)).all()
    got1, got2 = (np.asarray(d) for d in lora_delta(x, order, sizes, inverse, jnp.concatenate([a1, a2], -1),
                                                   (b1, b2), grouped_fn=fn))
    padded = np.concatenate([slots, [-1, -1]])
    np.testing.assert_allclose(got1, lora_delta_reference(x, padded, a1, b1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got2, lora_delta_reference(x, padded, a2, b2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got1[3], np.asarray(x[3]) @ np.asarray(a1[2]) @ np.asarray(b1[2]), rtol=1e-5,
                               atol=1e-5)
    assert not got1[[1, 5, 9, 11, 12]].any()                  # the base model's rows and the padding: nothing added
    order, sizes, inverse = lora_rows(np.full(11, -1, np.int32), 3, 13)
    for delta in lora_delta(x, order, sizes, inverse, jnp.concatenate([a1, a2], -1), (b1, b2), grouped_fn=fn):
        np.testing.assert_array_equal(delta, 0.0)


def test_rslora_scales_by_the_square_root_of_the_rank(peft_adapter, tmp_path):
    folder, _ = peft_adapter
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**raw, "use_rslora": True}))
    plain, rs = load_adapter(folder, CONFIG, 4), load_adapter(tmp_path, CONFIG, 4)
    assert rs.config.scale == 12 / math.sqrt(4)
    np.testing.assert_allclose(rs.weights["q_proj"][1], plain.weights["q_proj"][1] * (6.0 / 3.0), rtol=1e-6)
    assert rs.digest != plain.digest                                         # the content, not the name


@pytest.mark.parametrize("change, message", [
    (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json: no adapter_config.json"),
    (lambda f: (f / "adapter_model.safetensors").unlink(), "adapter_model.safetensors: missing"),
    (lambda f: _config(f, r=16), "adapter_config.json: r: 16 exceeds max_lora_rank=8"),
    (lambda f: _config(f, target_modules=["q_proj", "lm_head"]), "adapter_config.json: target_modules: must be among"),
    (lambda f: _config(f, peft_type="IA3"), "adapter_config.json: peft_type: only LORA adapters are served"),
    (lambda f: _config(f, use_dora=True), "adapter_config.json: use_dora: not supported"),
    (lambda f: _config(f, rank_pattern={"q_proj": 8}), "adapter_config.json: rank_pattern: not supported"),
    (lambda f: _tensor(f, "base_model.model.lm_head.lora_magnitude_vector"), "lora_magnitude_vector: not a LoRA A or B"),
])
def test_a_bad_adapter_is_an_error_naming_the_file_and_field(peft_adapter, tmp_path, change, message):
    folder, _ = peft_adapter
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    change(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_adapter(tmp_path, CONFIG, max_rank=8)


def test_an_adapter_for_other_shapes_names_the_tensor(peft_adapter):
    folder, _ = peft_adapter
    wider = ModelConfig(**{**CONFIG.__dict__, "hidden_size": 40})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.lora_B\.weight: shape \[32, 4\], the model needs \[40, 4\]"):
        load_adapter(folder, wider, max_rank=8)


def _config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _tensor(folder, name: str) -> None:
    from safetensors.numpy import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({**load_file(str(path)), name: np.ones(4, np.float32)}, str(path))
