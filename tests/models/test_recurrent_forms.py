"""The recurrent layers' chunked form (segments of one row's tokens) equals their plain form (one
token after another) on ragged batches: rows of many lengths with states from earlier steps,
segments cut by a small chunk size and by snapshots, and padding past the real tokens; and on a
decode step, whose rows' tokens the chunked form updates all at once."""
import numpy as np
import pytest

from flax import nnx
import jax.numpy as jnp

from jaxengine.models.config import GatedDeltaNetShape, Mamba2Shape
from jaxengine.models.gated_deltanet import GatedDeltaNet
from jaxengine.models.mamba2 import Mamba2


def layer(kind: str):
    rngs = nnx.Rngs(0)
    if kind == "gated deltanet":
        shape = GatedDeltaNetShape(32, 2, 4, 8, 6, 4)
        ours = GatedDeltaNet(shape, jnp.float32, rngs=rngs)
    else:
        shape = Mamba2Shape(32, 4, 6, 8, 2, 4)
        ours = Mamba2(shape, jnp.float32, rngs=rngs)
        ours.conv_bias[...] = jnp.linspace(-0.5, 0.5, shape.conv_dim)
        ours.D[...] = jnp.linspace(-1, 1, shape.num_heads)
    rng = np.random.default_rng(3)
    for name in ("A_log", "dt_bias"):
        getattr(ours, name)[...] = jnp.asarray(rng.normal(size=getattr(ours, name)[...].shape).astype(np.float32))
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj", "conv_weight", "out_proj"):
        if hasattr(ours, name):
            w = getattr(ours, name)
            w[...] = jnp.asarray(rng.normal(size=w[...].shape).astype(np.float32) * 0.3)
    return ours, shape


@pytest.mark.parametrize("kind", ["gated deltanet", "mamba-2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_chunked_form_gives_the_plain_forms_outputs_states_and_snapshots(kind, seed):
    ours, shape = layer(kind)
    rng = np.random.default_rng(seed)
    lengths = [11, 1, 6, 1, 9]                             # prompts' chunks and decode tokens
    order = rng.permutation(len(lengths))
    rows = np.concatenate([[r] * lengths[r] for r in order]).astype(np.int32)
    num_valid = len(rows)
    rows = np.concatenate([rows, [len(lengths)] * 5]).astype(np.int32)          # padding
    x = jnp.asarray(rng.normal(size=(len(rows), 32)).astype(np.float32))
    conv_shape, state_shape = shape.state_shapes()
    conv = jnp.asarray(rng.normal(size=(len(lengths), *conv_shape)).astype(np.float32))
    state = jnp.asarray(rng.normal(size=(len(lengths), *state_shape)).astype(np.float32) * 0.3)
    captures = np.full(len(rows), 3, np.int32)
    captures[rng.choice(num_valid, 3, replace=False)] = [0, 1, 2]
    args = (x, jnp.asarray(rows), conv, state, None, jnp.asarray(captures), 3)
    ours.recurrent_form = "tokens"
    plain = ours(*args)
    ours.recurrent_form, ours.chunk_size = "chunked", 4
    chunked = ours(*args, num_valid=num_valid)
    np.testing.assert_allclose(np.asarray(chunked[0])[:num_valid], np.asarray(plain[0])[:num_valid],
                               rtol=2e-4, atol=2e-5)
    for a, b in zip(chunked[1:], plain[1:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kind", ["gated deltanet", "mamba-2"])
@pytest.mark.parametrize("snapshot", [False, True])
def test_a_decode_step_runs_its_rows_tokens_at_once_as_in_turn(kind, snapshot):
    """One token per row (three rows, a padding token last, a snapshot of row 1's states): the
    chunked form's batched update gives the in-turn scan's outputs, states and snapshots."""
    ours, shape = layer(kind)
    ours.recurrent_form = "chunked"
    rng = np.random.default_rng(2)
    conv_shape, state_shape = shape.state_shapes()
    conv = jnp.asarray(rng.normal(size=(3, *conv_shape)).astype(np.float32))
    state = jnp.asarray(rng.normal(size=(3, *state_shape)).astype(np.float32) * 0.3)
    x = jnp.asarray(rng.normal(size=(4, 32)).astype(np.float32))
    rows = jnp.asarray([2, 0, 1, 3])
    kw = dict(captures=jnp.asarray([1, 1, 0, 1]), num_captures=1) if snapshot else {}
    in_turn = ours(x, rows, conv, state, one_token_rows=jnp.asarray(False), **kw)
    at_once = ours(x, rows, conv, state, one_token_rows=jnp.asarray(True), **kw)
    assert len(at_once) == (5 if snapshot else 3)
    np.testing.assert_allclose(np.asarray(at_once[0])[:3], np.asarray(in_turn[0])[:3], rtol=1e-5, atol=1e-6)
    for a, b in zip(at_once[1:], in_turn[1:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
