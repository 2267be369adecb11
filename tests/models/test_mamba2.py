"""Mamba-2 (Nemotron-H's state-space layers) in plain JAX equals transformers' mixer on random
weights, over a ragged batch of two sequences whose states carry from one step to the next."""
import numpy as np
import pytest
import torch

from flax import nnx
import jax.numpy as jnp

from jaxengine.models.mamba2 import Mamba2, Mamba2Shape


@pytest.fixture(scope="module")
def layers():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = NemotronHConfig(hidden_size=32, layers_block_type=["linear_attention"], mamba_num_heads=4,
                          mamba_head_dim=6, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4)
    torch.manual_seed(0)
    hf = NemotronHMamba2Mixer(cfg, 0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.4 if "proj" in name or "conv" in name else 1.0))
        hf.A_log.copy_(torch.rand_like(hf.A_log).mul(2).log())        # decays of every size
    shape = Mamba2Shape(32, 4, 6, 8, 2, 4, rms_norm_eps=cfg.layer_norm_epsilon)
    ours = Mamba2(shape, jnp.float32, rngs=nnx.Rngs(0))
    t = {n: p.detach().numpy() for n, p in hf.named_parameters()}
    ours.in_proj[...], ours.out_proj[...] = jnp.asarray(t["in_proj.weight"].T), jnp.asarray(t["out_proj.weight"].T)
    ours.conv_weight[...] = jnp.asarray(t["conv1d.weight"][:, 0, :].T)
    ours.conv_bias[...] = jnp.asarray(t["conv1d.bias"])
    for name in ("dt_bias", "A_log", "D"):
        getattr(ours, name)[...] = jnp.asarray(t[name])
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
    assert (conv_shape, state_shape) == ((3, 24 + 2 * 2 * 8), (4, 6, 8))
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


@pytest.mark.parametrize("form", ["tokens", "chunked"])
def test_snapshots_hold_a_rows_states_after_the_chosen_tokens(layers, form):
    """A snapshot after token 3 of a row equals that row's states after a step of its first 4 tokens."""
    _, ours, shape = layers
    ours.recurrent_form = form
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(7, 32)).astype(np.float32))
    conv_shape, state_shape = shape.state_shapes()
    zeros = jnp.zeros((1, *conv_shape)), jnp.zeros((1, *state_shape))
    captures = jnp.asarray([1, 1, 1, 0, 1, 1, 1])         # token 3 -> snapshot 0 (1: none)
    *_, snap_conv, snap_state = ours(x, jnp.zeros(7, jnp.int32), *zeros, captures=captures, num_captures=1)
    _, conv4, state4 = ours(x[:4], jnp.zeros(4, jnp.int32), *zeros)
    np.testing.assert_array_equal(np.asarray(snap_conv), np.asarray(conv4))
    np.testing.assert_allclose(np.asarray(snap_state), np.asarray(state4), rtol=1e-6, atol=1e-7)
