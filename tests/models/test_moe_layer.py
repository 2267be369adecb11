"""The grouped mixture-of-experts layer against its dense reference (every expert on every token),
and the routing and grouping it is built from."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.kernels.matmul import xla_grouped_dense
from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import stacked
from jaxengine.models.moe import (ClampedSwiGLU, SparseMoeBlock, dense_reference, group_by_expert, route,
                                  with_quantized_experts)


def moe_config(experts: int, k: int, shared: int = 0, normalise: bool = True, gpt_oss: bool = False) -> ModelConfig:
    """``gpt_oss``: router and expert biases, the clamped SwiGLU (a limit low enough to clamp)."""
    extra = dict(router_bias=True, expert_bias=True, swiglu_limit=0.05, swiglu_alpha=1.702) if gpt_oss else {}
    return ModelConfig(architecture="Qwen2MoeForCausalLM", vocab_size=16, hidden_size=24, intermediate_size=40,
                       num_layers=1, num_heads=2, num_kv_heads=2, head_dim=12, num_experts=experts,
                       num_experts_per_tok=k, moe_intermediate_size=20, norm_topk_prob=normalise,
                       shared_expert_intermediate_size=shared, **extra)


def block(cfg: ModelConfig, seed: int) -> SparseMoeBlock:
    b = SparseMoeBlock(cfg, jnp.float32, rngs=nnx.Rngs(seed))
    b.router[...] = b.router[...] * 40                    # routing that differs from token to token
    if cfg.expert_bias:                                   # biases start at zero: make them count
        keys = iter(jax.random.split(jax.random.key(seed + 100), 4))
        for module, name in ((b, "router_bias"), (b.experts, "gate_bias"), (b.experts, "up_bias"),
                             (b.experts, "down_bias")):
            param = getattr(module, name)
            param[...] = jax.random.normal(next(keys), param.shape) * 0.05
    return b


def test_route_picks_the_top_k_softmax_weights_renormalised_or_not():
    logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25]]))
    w, e = route(logits, 2, normalise=False)
    np.testing.assert_array_equal(e, [[1, 3]])
    np.testing.assert_allclose(w, [[0.5, 0.25]], rtol=1e-6)
    w, _ = route(logits, 2, normalise=True)
    np.testing.assert_allclose(w, [[2 / 3, 1 / 3]], rtol=1e-6)


def test_grouping_sorts_pairs_by_expert_and_leaves_the_padding_out():
    experts = jnp.asarray([[2, 0], [1, 2], [0, 1]])       # token 2 is padding
    order, sizes = group_by_expert(experts, 4, num_valid=2)
    np.testing.assert_array_equal(sizes, [1, 1, 2, 0])
    np.testing.assert_array_equal(order[:4], [1, 2, 0, 3])         # pair (t, c) is t*2 + c
    assert set(np.asarray(order[4:]).tolist()) == {4, 5}


@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(1, 24), experts=st.integers(1, 8), data=st.data(), seed=st.integers(0, 3))
def test_the_grouped_layer_equals_every_expert_on_every_token_masked(tokens, experts, data, seed):
    k = data.draw(st.integers(1, experts))
    shared = data.draw(st.sampled_from([0, 16]))
    cfg = moe_config(experts, k, shared, normalise=data.draw(st.booleans()), gpt_oss=data.draw(st.booleans()))
    b = block(cfg, seed)
    x = jax.random.normal(jax.random.key(seed), (tokens, cfg.hidden_size))
    (out, counts), want = jax.jit(lambda x: (b(x), dense_reference(b, x)))(x)      # one compile, not one per op
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    assert int(counts.sum()) == tokens * k


def test_experts_no_token_chose_cost_nothing_and_padding_routes_nowhere():
    cfg = moe_config(8, 1)
    b = block(cfg, 0)
    x = jax.random.normal(jax.random.key(1), (5, cfg.hidden_size))
    _, chosen = route(x @ b.router[...], 1, True)
    assert len(set(np.asarray(chosen).ravel().tolist())) < 8        # some experts idle
    out, counts = b(x, num_valid=3)
    assert int(counts.sum()) == 3
    np.testing.assert_allclose(out[:3], dense_reference(b, x)[:3], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out[3:], 0.0)                     # no shared expert: nothing at all


def test_the_clamped_swiglu_clamps_the_gate_above_and_up_both_sides():
    act = ClampedSwiGLU(limit=1.0, alpha=2.0)
    gate, up = jnp.asarray([3.0, -3.0, 0.5]), jnp.asarray([-5.0, 5.0, 0.25])
    sig = lambda z: 1 / (1 + np.exp(-z))                      # noqa: E731
    want = [1.0 * sig(2.0) * 0.0, -3.0 * sig(-6.0) * 2.0, 0.5 * sig(1.0) * 1.25]
    np.testing.assert_allclose(act(gate, up), want, rtol=1e-6)


def test_gpt_oss_experts_clamp_and_their_biases_count_and_the_padding_still_routes_nowhere():
    cfg = moe_config(6, 2, gpt_oss=True)
    b = block(cfg, 3)
    x = jax.random.normal(jax.random.key(4), (7, cfg.hidden_size))
    out, counts = b(x, num_valid=5)
    np.testing.assert_allclose(out[:5], dense_reference(b, x)[:5], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(out[5:], 0.0)
    assert int(counts.sum()) == 10
    b.experts.down_bias[...] = jnp.zeros_like(b.experts.down_bias[...])
    assert not np.allclose(b(x, num_valid=5)[0][:5], out[:5])      # the down bias was in the output


def test_the_stacked_layer_index_picks_that_layers_experts():
    cfg = moe_config(4, 2)
    stack = stacked(lambda r: SparseMoeBlock(cfg, jnp.float32, rngs=r), 3, nnx.Rngs(0))
    stack.router[...] = stack.router[...] * 40
    x = jax.random.normal(jax.random.key(2), (6, cfg.hidden_size))
    for layer in range(3):
        np.testing.assert_allclose(stack(x, jnp.int32(layer))[0], dense_reference(stack, x, layer), rtol=1e-4,
                                   atol=1e-5)


def test_xla_ragged_dot_path_gives_the_same_product():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 8), np.float32)
    w = rng.standard_normal((3, 8, 5), np.float32)
    sizes = jnp.asarray([4, 0, 3])                                 # rows 7, 8: padding
    out = np.asarray(xla_grouped_dense(jnp.asarray(x), jnp.asarray(w), sizes))
    np.testing.assert_allclose(out[:4], x[:4] @ w[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[4:7], x[4:7] @ w[2], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[7:], 0.0)


def test_a_layer_with_its_experts_quantized_computes_the_dequantised_experts():
    from jaxengine.kernels.matmul.quantized import dequantize
    from jaxengine.models.quantization import QuantizedParam

    cfg = moe_config(4, 2, shared=16, gpt_oss=True)
    b = block(cfg, 0)
    x = jax.random.normal(jax.random.key(1), (6, cfg.hidden_size))
    for scheme in ("fp8", "int8", "int4"):
        q = with_quantized_experts(b, scheme)
        assert isinstance(q.experts.down_proj, QuantizedParam) and q.cfg.quant_spec("experts.down_proj")[0] == scheme
        same = block(cfg, 0)                                   # the f32 layer holding the dequantised experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(same.experts, name)[...] = dequantize(getattr(q.experts, name)[...])
        np.testing.assert_allclose(q(x)[0], same(x)[0], rtol=1e-5, atol=1e-6, err_msg=scheme)
        np.testing.assert_array_equal(q(x)[1], b(x)[1])        # the same routing: router and biases copied
