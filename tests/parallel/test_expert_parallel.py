"""A mixture of experts over 8 simulated CPU devices: tensor parallelism (every expert split by its
width) and expert parallelism (whole experts per device) give the greedy tokens of transformers,
data parallelism on top; the experts lie where the layout says; a split that cannot be is refused."""
import jax
import pytest

from jaxengine import LLM
from jaxengine.parallel.data_parallel import DataParallelEngine
from tests.e2e.test_generate_vs_transformers import reference
from tests.parallel.test_tensor_parallel import MAX_TOKENS, PROMPTS, greedy_tokens, tp_engine

# 8 experts, a shared one, and a dense layer among the sparse ones (both MLP stacks on the mesh)
MOE = dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("ep-qwen2-moe")
    hf = make_checkpoint(folder, "qwen2_moe", **MOE)
    return folder, reference(hf, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("tp, ep", [(2, False), (4, False), (2, True), (4, True), (8, True)])
def test_greedy_tokens_equal_transformers_split_by_width_or_by_expert(moe, tp, ep):
    folder, expected = moe
    llm = tp_engine(folder, tp, enable_expert_parallel=ep)
    gate = llm.runner.state["sparse_mlp"]["experts"]["gate_proj"]          # [layers, E, D, F]
    split = gate.sharding.shard_shape(gate.shape)
    assert split == ((2, 8 // tp, 64, 32) if ep else (2, 8, 64, 32 // tp))
    outs = greedy_tokens(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss (8 heads, 8 experts) and transformers' greedy tokens for it."""
    from tests.conftest import MOE_VARIANTS, make_checkpoint

    folder = tmp_path_factory.mktemp("tp-gpt-oss")
    model_type, overrides = MOE_VARIANTS["gpt-oss"]
    hf = make_checkpoint(folder, model_type, **{**overrides, "num_hidden_layers": 2, "num_attention_heads": 8,
                                                "num_key_value_heads": 2, "num_local_experts": 8,
                                                "intermediate_size": 32})
    return folder, reference(hf, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("tp, ep", [(2, False), (4, True)])
def test_gpt_oss_split_by_width_or_by_expert_keeps_the_tokens(gpt_oss, tp, ep):
    """Sinks split with the query heads, expert biases with the experts' columns or whole experts,
    the o_proj and down biases added once after the sums."""
    folder, expected = gpt_oss
    llm = tp_engine(folder, tp, enable_expert_parallel=ep)
    sinks = llm.runner.state["layers"]["self_attn"]["sinks"]                 # [layers, N]
    assert sinks.sharding.shard_shape(sinks.shape) == (2, 8 // tp)
    bias = llm.runner.state["layers"]["mlp"]["experts"]["gate_bias"]         # [layers, E, F]
    assert bias.sharding.shard_shape(bias.shape) == ((2, 8 // tp, 32) if ep else (2, 8, 32 // tp))
    outs = greedy_tokens(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_data_parallel_replicas_of_expert_parallel_meshes(moe):
    folder, expected = moe
    llm = tp_engine(folder, 2, enable_expert_parallel=True, data_parallel_size=2)
    assert isinstance(llm.engine, DataParallelEngine)
    outs = greedy_tokens_dp(llm)
    assert [o.outputs[0].token_ids for o in outs] == expected


def greedy_tokens_dp(llm):
    from jaxengine import SamplingParams

    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)


def test_expert_parallelism_that_cannot_split_is_refused(moe, tmp_path):
    folder, _ = moe
    from tests.conftest import make_checkpoint

    odd = tmp_path / "six"
    make_checkpoint(odd, "qwen2_moe", **{**MOE, "num_experts": 6})
    with pytest.raises(ValueError, match=r"enable_expert_parallel: the 6 experts of Qwen2MoeForCausalLM do not split "
                                         r"over 4 devices"):
        LLM(odd, skip_tokenizer_init=True, tensor_parallel_size=4, enable_expert_parallel=True, progress=False)
    dense = tmp_path / "dense"
    make_checkpoint(dense, "llama", num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts to split"):
        LLM(dense, skip_tokenizer_init=True, tensor_parallel_size=2, enable_expert_parallel=True, progress=False)
    assert jax.device_count() == 8


@pytest.mark.parametrize("gpt_oss_experts", [False, True])
def test_all_to_all_dispatch_equals_one_device(gpt_oss_experts):
    """The dispatch layout the engine measures against: tokens split over 8 devices, pairs sent to
    their experts' devices and back; token counts that do not split evenly and padding included."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxengine.models.mesh import AllToAllExperts, make_mesh, place_model
    from jaxengine.models.moe import SparseMoeBlock
    from tests.models.test_moe_layer import block, moe_config

    cfg = moe_config(16, 3, gpt_oss=gpt_oss_experts)
    one = block(cfg, 5)
    spread = SparseMoeBlock(cfg, jnp.float32, expert_parallel=True, rngs=nnx.Rngs(0))
    nnx.update(spread, nnx.state(one))
    place_model(spread, make_mesh(jax.devices()[:8]))
    spread.experts.experts_fn = AllToAllExperts(make_mesh(jax.devices()[:8]))
    for tokens, valid in ((1, 1), (13, 13), (24, 20)):
        x = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size))
        want, want_counts = one(x, num_valid=valid)
        got, counts = jax.jit(lambda x: spread(x, num_valid=valid))(x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(counts, want_counts)


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    """Experts (and the shared one) 256 wide: the down projections' groups of 128 stay whole in a
    device's share, so one device and two hold the same quantized values."""
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("ep-quantized")
    make_checkpoint(folder, "qwen2_moe", **{**MOE, "num_hidden_layers": 2, "mlp_only_layers": [],
                                            "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256})
    one = greedy_tokens(tp_engine(folder, 1, quantization="int4"), PROMPTS)
    return folder, [o.outputs[0].token_ids for o in one]


@pytest.mark.parametrize("ep", [False, True])
def test_quantized_experts_split_by_width_or_by_expert_give_one_devices_tokens(wide_moe, ep):
    # int4 experts: packed values, scales and offsets split with the experts' columns or whole experts
    folder, one = wide_moe
    two = tp_engine(folder, 2, quantization="int4", enable_expert_parallel=ep)
    down = two.model.layers.mlp.experts.down_proj                                # [L, E, F/P, D]
    assert down.q.sharding.spec[1 if ep else 2] == "model" and down.scale.sharding.spec[1 if ep else 2] == "model"
    assert [o.outputs[0].token_ids for o in greedy_tokens(two, PROMPTS)] == one
