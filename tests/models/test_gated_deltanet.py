"""Gated DeltaNet (Qwen3.5's linear attention) in plain JAX equals transformers' layer on random
weights, over a ragged batch of two sequences whose states carry from one step to the next."""
import numpy as np
import pytest
import torch

from flax import nnx
import jax.numpy as jnp

from jaxengine.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape


@pytest.fixture(scope="module")
def layers():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)
    assert cfg.layer_types[0] == "linear_attention"
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
        hf.A_log.copy_(torch.rand_like(hf.A_log).mul(2).log())        # decays of every size
    shape = GatedDeltaNetShape(32, 2, 4, 8, 6, 4, cfg.rms_norm_eps)
    ours = GatedDeltaNet(shape, jnp.float32, rngs=nnx.Rngs(0))
    t = {n: p.detach().numpy() for n, p in hf.named_parameters()}
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        getattr(ours, name)[...] = jnp.asarray(t[f"{name}.weight"].T)
    ours.conv_weight[...] = jnp.asarray(t["conv1d.weight"][:, 0, :].T)
    ours.dt_bias[...], ours.A_log[...] = jnp.asarray(t["dt_bias"]), jnp.asarray(t["A_log"])
    ours.norm_weight[...] = jnp.asarray(t["norm.weight"])
    return hf, ours, shape


@pytest.mark.parametrize("form", ["tokens", "chunked"])
def test_a_ragged_batch_over_two_steps_gives_transformers_outputs(layers, form):
    hf, ours, shape = layers
    ours.recurrent_form = form
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(9, 32)).astype(np.float32), rng.normal(size=(4, 32)).astype(np.float32)
    with torch.no_grad():
        expected = [hf(torch.tensor(x)[None])[0].numpy() for x in (a, b)]
    conv_shape, state_shape = shape.state_shapes()
    conv, state = jnp.zeros((2, *conv_shape)), jnp.zeros((2, *state_shape))
    # Step 1: a's first 6 tokens (row 0), b's first 3 (row 1), 2 padding tokens (row 2: none).
    x1 = np.concatenate([a[:6], b[:3], np.ones((2, 32), np.float32)])
    out1, conv, state = ours(jnp.asarray(x1), jnp.asarray([0] * 6 + [1] * 3 + [2] * 2), conv, state)
    # Step 2: b's last token first (row 0 now), then a's last 3 (row 1): the states follow their rows.
    x2 = np.concatenate([b[3:], a[6:]])
    out2, _, _ = ours(jnp.asarray(x2), jnp.asarray([0] + [1] * 3), conv[::-1], state[::-1])
    out1, out2 = np.asarray(out1), np.asarray(out2)
    np.testing.assert_allclose(np.concatenate([out1[:6], out2[1:]]), expected[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.concatenate([out1[6:9], out2[:1]]), expected[1], atol=2e-5, rtol=1e-4)
