"""DeepSeek-V3's multi-token prediction layer: read from the checkpoint's layer L, its logits are
those of transformers' own decoder layer, norms and projection applied as the layer defines them;
as the speculative proposer (``method: mtp``) it drafts, and the outputs stay the model's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.llama import init_kv_caches
from tests.conftest import make_deepseek_checkpoint
from tests.e2e.test_generate_vs_transformers import PROMPTS, engine, greedy, reference


def add_mtp_layer(folder, hf) -> dict:
    """Write a random MTP layer (layer L of the checkpoint, DeepSeek's names, the embedding and
    LM head repeated as released checkpoints repeat them) beside the model's tensors; -> its
    torch modules."""
    from safetensors.torch import save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    cfg = hf.config
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(5)
    parts = {"block": DeepseekV3DecoderLayer(cfg, L), "enorm": DeepseekV3RMSNorm(d), "hnorm": DeepseekV3RMSNorm(d),
             "eh_proj": torch.nn.Linear(2 * d, d, bias=False), "shared_norm": DeepseekV3RMSNorm(d)}
    with torch.no_grad():
        for module in parts.values():
            for name, p in module.named_parameters():
                p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
        parts["block"].mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.5)
    prefix = f"model.layers.{L}."
    tensors = {prefix + k: v for k, v in parts["block"].state_dict().items()}
    tensors.update({prefix + "enorm.weight": parts["enorm"].weight, prefix + "hnorm.weight": parts["hnorm"].weight,
                    prefix + "eh_proj.weight": parts["eh_proj"].weight,
                    prefix + "shared_head.norm.weight": parts["shared_norm"].weight,
                    prefix + "shared_head.head.weight": hf.lm_head.weight,
                    prefix + "embed_tokens.weight": hf.model.embed_tokens.weight})
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(folder / "mtp.safetensors"))
    parts["block"].self_attn.config._attn_implementation = "eager"
    return parts


def mtp_reference(hf, parts, ids: list[int]) -> np.ndarray:
    """Logits [n - 1, V] of the MTP layer at positions 0 .. n-2 (each with the token after it)."""
    n = len(ids)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]       # the normed output
        assert torch.allclose(hidden, hf.model(torch.tensor([ids])).last_hidden_state)
        embeds = hf.model.embed_tokens(torch.tensor([ids[1:]]))
        x = parts["eh_proj"](torch.cat([parts["enorm"](embeds), parts["hnorm"](hidden[:, :-1])], dim=-1))
        positions = torch.arange(n - 1)[None]
        mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
        out = parts["block"](x, attention_mask=mask, position_ids=positions,
                             position_embeddings=hf.model.rotary_emb(x, positions))
        return hf.lm_head(parts["shared_norm"](out))[0].numpy()


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-mtp")
    hf = make_deepseek_checkpoint(folder, "no-q-lora")
    return folder, hf, add_mtp_layer(folder, hf)


def test_the_mtp_layer_predicts_as_transformers_layer_does(mtp_checkpoint):
    from flax import nnx

    from jaxengine.models.forward import make_forward
    from jaxengine.models.weights import load_model, load_mtp

    folder, hf, parts = mtp_checkpoint
    model, cfg = load_model(folder)
    head, _ = load_mtp(folder, model, cfg, jnp.float32)
    assert head.config.sparse_layers == (0,) and head.embed_tokens is model.embed_tokens      # experts; shared arrays
    ids = PROMPTS[4]                                             # 30 tokens
    n, block = len(ids), 4
    md = AttentionMetadata.build([(0, n, list(range(1, 9)))], block, num_tokens=32, max_blocks=8)
    md = jax.tree.map(jnp.asarray, md)
    state, forward = make_forward(model, head=lambda m, h, rows: (h[rows],), aux_layers=(cfg.num_layers,))
    _, (_, _, hidden) = forward(state, init_kv_caches(cfg, 10, block), jnp.asarray(ids + [0] * (32 - n)), md,
                                jnp.arange(1))
    next_ids = jnp.asarray(ids[1:] + [0] * (33 - n))

    @nnx.jit
    def mtp_logits(head, next_ids, hidden, caches):
        normed, _, _ = head(next_ids, head.combine(hidden), caches, md)
        return head.model_logits(normed)

    ours = np.asarray(mtp_logits(head, next_ids, hidden, init_kv_caches(head.config, 10, block)))[:n - 1]
    want = mtp_reference(hf, parts, ids)
    np.testing.assert_allclose(ours, want, rtol=2e-4, atol=2e-4)
    assert (ours.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("devices", [1, 2])
def test_mtp_drafts_and_the_outputs_stay_the_models(mtp_checkpoint, devices):
    """On one device, and over two (heads split, the latent caches replicated, the model's and
    the MTP layer's alike)."""
    folder, hf, _ = mtp_checkpoint
    llm = engine(folder, tensor_parallel_size=devices, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference(hf, PROMPTS)
    assert sum(t.num_draft_tokens for t in llm.engine.traces) > 0


def test_mtp_without_its_layer_in_the_checkpoint_is_refused(tmp_path):
    make_deepseek_checkpoint(tmp_path, "no-q-lora")
    with pytest.raises(ValueError, match=r"'mtp': .* holds no tensors of a multi-token prediction layer "
                                         r"\(model\.layers\.3\.eh_proj\.weight"):
        engine(tmp_path, speculative_config={"method": "mtp"})


def test_a_checkpoint_stored_in_fp8_blocks_drafts_with_its_mtp_layer(mtp_checkpoint, tmp_path):
    """DeepSeek-V3's own release: projections stored float8 in 128 x 128 blocks with
    ``weight_scale_inv`` (here blocks of 4), the latent ones and the MTP layer's too. The model
    keeps the kinds it can quantized and reads the latent projections dequantised, the MTP layer
    is read dequantised, and drafting changes no output."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from tests.models.test_stored_quantization import fp8_blocks

    folder, _, _ = mtp_checkpoint
    for name in ("config.json", "generation_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    for file in ("model.safetensors", "mtp.safetensors"):
        tensors = load_file(str(folder / file))
        for name in [n for n, w in tensors.items() if n.endswith(("proj.weight", "mqa.weight")) and w.ndim == 2]:
            q, scale, _ = fp8_blocks(tensors[name].float(), (4, 4))
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, scale
        save_file(tensors, str(tmp_path / file))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [4, 4]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    plain = greedy(engine(tmp_path), PROMPTS)
    llm = engine(tmp_path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.model_config.quant_spec("o_proj") is not None                  # kept quantized
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert sum(t.num_draft_tokens for t in llm.engine.traces) > 0
