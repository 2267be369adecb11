"""The start-up kernel check, forced on the CPU: the Pallas kernels (interpreted) pass and stay;
a wrong kernel, one that fails to compile and a wrong KV write are replaced by the plain-jnp path."""
import logging

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxengine.kernels.paged_attention import paged_attention_tiled, write_kv
from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas
from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas
from jaxengine.llm import LLM
from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.runner import kernel_check
from jaxengine.runner.kernel_check import check_kernels, check_model_kernels

CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=256)


def wrong_scale(q, k_cache, v_cache, md, *, scale, **kw):
    return paged_attention_tiled(q, k_cache, v_cache, md, scale=scale * 1.5, **kw)


def fails_to_compile(q, k_cache, v_cache, md, **kw):
    raise NotImplementedError("no lowering for this layout")


def off_by_one_slot(k_cache, v_cache, k, v, slot_mapping):
    return write_kv(k_cache, v_cache, k, v, slot_mapping + 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_pass(dtype):
    assert check_kernels(paged_attention_pallas, write_kv_pallas, CFG, 16, dtype) == (None, None)


def test_a_wrong_kernel_is_caught():
    attention, kv = check_kernels(wrong_scale, write_kv, CFG, 16, jnp.float32)
    assert attention.startswith("disagrees with the plain-jnp path: max |difference| ") and kv is None


def test_a_kernel_that_fails_to_compile_is_caught():
    attention, _ = check_kernels(fails_to_compile, write_kv, CFG, 16, jnp.float32)
    assert attention == "failed: NotImplementedError: no lowering for this layout"


def test_a_wrong_kv_write_is_caught():
    attention, kv = check_kernels(paged_attention_tiled, off_by_one_slot, CFG, 16, jnp.float32)
    assert attention is None and kv.startswith("disagrees with the XLA scatter: ")


def model_with(attention_fn, kv_write_fn):
    model = LlamaForCausalLM(CFG, jnp.float32, attention_fn, rngs=nnx.Rngs(0))
    model.layers.self_attn.kv_write_fn = kv_write_fn
    return model


def test_failing_kernels_fall_back_to_the_plain_jnp_path_and_say_why(caplog):
    model = model_with(wrong_scale, off_by_one_slot)
    with caplog.at_level(logging.WARNING, logger=kernel_check.__name__):
        check_model_kernels(model, CFG, 16, jnp.float32, enabled=True)
    assert model.layers.self_attn.attention_fn is paged_attention_tiled
    assert model.layers.self_attn.kv_write_fn is write_kv
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("attention kernel wrong_scale disagrees with the plain-jnp path")
    assert messages[0].endswith("; using the plain-jnp path instead")
    assert messages[1].startswith("KV write off_by_one_slot disagrees with the XLA scatter")


def test_kernels_that_pass_are_kept():
    model = model_with(paged_attention_pallas, write_kv_pallas)
    check_model_kernels(model, CFG, 16, jnp.float32, enabled=True)
    assert model.layers.self_attn.attention_fn is paged_attention_pallas
    assert model.layers.self_attn.kv_write_fn is write_kv_pallas


def test_the_cpu_does_not_check_by_default():
    model = model_with(wrong_scale, off_by_one_slot)
    check_model_kernels(model, CFG, 16, jnp.float32)
    assert model.layers.self_attn.attention_fn is wrong_scale


@pytest.mark.parametrize("skip", [False, True])
def test_the_llm_checks_on_an_accelerator_unless_told_to_skip(monkeypatch, skip):
    monkeypatch.setattr(kernel_check, "_on_accelerator", lambda: True)
    model = model_with(fails_to_compile, write_kv)
    LLM(model, model_config=CFG, block_size=16, num_kv_blocks=16, warm_up=False, progress=False,
        skip_kernel_check=skip)
    # The runner runs the kernel per shard of its mesh: the kernel chosen is the one it wraps.
    assert model.layers.self_attn.attention_fn.inner is (fails_to_compile if skip else paged_attention_tiled)
