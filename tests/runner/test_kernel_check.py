"""The start-up kernel check, forced on the CPU: the Pallas kernels (interpreted) pass and stay,
over an FP8 cache, with sinks and sliding windows, and in latent attention's absorbed form; a wrong
kernel, one that fails to compile and a wrong KV write are replaced by the plain-jnp path, and the
report says so."""
import logging

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxengine.kernels.paged_attention import paged_attention_tiled, write_kv
from jaxengine.kernels.paged_attention.backend import where_served
from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas
from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas
from jaxengine.kernels.paged_attention.layout import FP8, FP8_BYTES
from jaxengine.llm import LLM
from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.runner import kernel_check
from jaxengine.runner.kernel_check import KernelCheck, KernelResult, check_kernels, check_latent_kernel, \
    check_model_kernels

CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
# gpt-oss's attention: sinks, and sliding layers (window 7) among full ones.
SINKS = CFG.replace(attention_sinks=True, sliding_window=7, full_attention_layers=(1,))
# Latent attention: one key head of R + Hr = 48 + 16, a power of two the Pallas kernel takes.
LATENT = ModelConfig("DeepseekV3ForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=256, kv_lora_rank=48,
                     qk_nope_head_dim=16, v_head_dim=16)


def wrong_scale(q, k_cache, v_cache, md, *, scale, **kw):
    return paged_attention_tiled(q, k_cache, v_cache, md, scale=scale * 1.5, **kw)


def fails_to_compile(q, k_cache, v_cache, md, **kw):
    raise NotImplementedError("no lowering for this layout")


def off_by_one_slot(k_cache, v_cache, k, v, slot_mapping):
    return write_kv(k_cache, v_cache, k, v, slot_mapping + 1)


def without_sinks(q, k_cache, v_cache, md, *, sinks=None, **kw):
    return paged_attention_tiled(q, k_cache, v_cache, md, **kw)


def without_window(q, k_cache, v_cache, md, *, sliding_window=None, **kw):
    return paged_attention_tiled(q, k_cache, v_cache, md, **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_pass(dtype):
    assert check_kernels(paged_attention_pallas, write_kv_pallas, CFG, 16, dtype) == (None, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_pass_over_an_fp8_cache_as_an_accelerator_stores_it(dtype):
    assert check_kernels(paged_attention_pallas, write_kv_pallas, CFG, 16, dtype, kv_dtype=FP8) == (None, None)


def test_the_pallas_kernels_pass_over_the_cpus_fp8_bytes():
    """On the CPU an FP8 cache is stored as its bytes: the Pallas kernels view them as float8 as they
    load them and write the rows' float8 bytes, as the plain-jnp path and the XLA scatter do."""
    assert check_kernels(paged_attention_pallas, write_kv_pallas, CFG, 16, jnp.float32, kv_dtype=FP8_BYTES) == \
        (None, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_pass_with_sinks_and_windows(dtype):
    assert check_kernels(paged_attention_pallas, write_kv_pallas, SINKS, 16, dtype) == (None, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_kernel_without_sinks_or_without_the_window_is_caught(dtype):
    attention, _ = check_kernels(without_sinks, write_kv, SINKS, 16, dtype)
    assert attention.startswith("disagrees with the plain-jnp path: max |difference| ")
    attention, _ = check_kernels(without_window, write_kv, SINKS, 16, dtype)
    assert attention.startswith("disagrees with the plain-jnp path") and attention.endswith("(sliding window 7)")


@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_the_pallas_kernel_passes_in_latent_attentions_absorbed_form(kv_dtype):
    assert check_latent_kernel(where_served(paged_attention_pallas), LATENT, 16, jnp.float32, kv_dtype=kv_dtype) is None


def test_a_wrong_latent_kernel_is_caught():
    problem = check_latent_kernel(where_served(wrong_scale), LATENT, 16, jnp.float32)
    assert problem.startswith("disagrees with the plain-jnp path: max |difference| ")


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


SCOPE = "attention (8 query and 2 KV heads of 32, float32 queries, float32 cache, pages of 16)"


def test_failing_kernels_fall_back_to_the_plain_jnp_path_and_say_why(caplog):
    model = model_with(wrong_scale, off_by_one_slot)
    with caplog.at_level(logging.WARNING, logger=kernel_check.__name__):
        check = check_model_kernels(model, CFG, 16, jnp.float32, enabled=True)
    assert model.layers.self_attn.attention_fn is paged_attention_tiled
    assert model.layers.self_attn.kv_write_fn is write_kv
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("attention kernel wrong_scale disagrees with the plain-jnp path")
    assert messages[0].endswith(f" on {SCOPE}; using the plain-jnp path instead")
    assert messages[1].startswith("KV write off_by_one_slot disagrees with the XLA scatter")
    assert (check.status, check.detail) == ("failed", SCOPE)
    attention, kv = check.results
    assert (attention.kernel, attention.name, attention.ok, attention.fallback) == \
        ("attention", "wrong_scale", False, "paged_attention_tiled")
    assert (kv.kernel, kv.name, kv.ok, kv.fallback) == ("kv_write", "off_by_one_slot", False, "write_kv")
    assert check.as_dict()["kernels"][1] == {"kernel": "kv_write", "name": "off_by_one_slot", "ok": False,
                                             "problem": kv.problem, "serving": "write_kv"}


def test_kernels_that_pass_are_kept(caplog):
    model = model_with(paged_attention_pallas, write_kv_pallas)
    with caplog.at_level(logging.INFO, logger=kernel_check.__name__):
        check = check_model_kernels(model, CFG, 16, jnp.float32, enabled=True)
    assert model.layers.self_attn.attention_fn is paged_attention_pallas
    assert model.layers.self_attn.kv_write_fn is write_kv_pallas
    assert check == KernelCheck("passed", SCOPE, (KernelResult("attention", "paged_attention_pallas"),
                                                  KernelResult("kv_write", "write_kv_pallas")))
    assert [r.getMessage() for r in caplog.records] == [
        f"attention kernel paged_attention_pallas matches the plain-jnp path on {SCOPE}",
        f"KV write write_kv_pallas matches the XLA scatter on {SCOPE}"]


def test_the_check_runs_in_the_engines_kv_dtype_with_sinks_and_windows():
    model = LlamaForCausalLM(SINKS, jnp.bfloat16, paged_attention_pallas, rngs=nnx.Rngs(0))
    model.layers.self_attn.kv_write_fn = write_kv_pallas
    check = check_model_kernels(model, SINKS, 16, jnp.bfloat16, kv_dtype=FP8, enabled=True)
    # The tests' CPU stores an FP8 cache as bytes, which the Pallas kernels read and write as float8.
    assert check == KernelCheck(
        "passed", "attention (8 query and 2 KV heads of 32, bfloat16 queries, float8_e4m3fn (as bytes) cache, pages "
        "of 16, sinks, full and sliding window 7 (reached))",
        (KernelResult("attention", "paged_attention_pallas"), KernelResult("kv_write", "write_kv_pallas")))
    assert model.layers.self_attn.attention_fn is paged_attention_pallas
    assert model.layers.self_attn.kv_write_fn is write_kv_pallas


@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_latent_attention_is_checked_in_its_absorbed_form(form):
    model = LlamaForCausalLM(LATENT, jnp.float32, wrong_scale, rngs=nnx.Rngs(0), latent_attention_form=form)
    check = check_model_kernels(model, LATENT, 16, jnp.float32, enabled=True)
    if form == "decompressed":          # plain jnp: no kernel runs
        assert check == KernelCheck("not run", "only the plain-jnp path serves: nothing to check")
        return
    assert model.layers.self_attn.attention_fn is paged_attention_tiled
    assert check.status == "failed" and check.detail == (
        "latent attention (absorbed form, 4 query heads over one key head of 64), float32 queries, float32 cache, "
        "pages of 16")
    (result,) = check.results
    assert (result.kernel, result.name, result.ok) == ("latent_attention", "wrong_scale", False)


def test_the_cpu_does_not_check_by_default():
    model = model_with(wrong_scale, off_by_one_slot)
    check = check_model_kernels(model, CFG, 16, jnp.float32)
    assert model.layers.self_attn.attention_fn is wrong_scale
    assert check == KernelCheck("not run", "on the CPU only when forced: the plain-jnp path serves")
    assert check_model_kernels(model, CFG, 16, jnp.float32, enabled=False).detail == "turned off (skip_kernel_check)"


@pytest.mark.parametrize("skip", [False, True])
def test_the_llm_checks_on_an_accelerator_unless_told_to_skip(monkeypatch, skip):
    monkeypatch.setattr(kernel_check, "_on_accelerator", lambda: True)
    model = model_with(fails_to_compile, write_kv)
    LLM(model, model_config=CFG, block_size=16, num_kv_blocks=16, warm_up=False, progress=False,
        skip_kernel_check=skip)
    # The engine runs the kernel that the check left per shard of its mesh (of one device here).
    assert model.layers.self_attn.attention_fn.inner is (fails_to_compile if skip else paged_attention_tiled)


def test_data_parallel_replicas_run_what_the_check_left(monkeypatch):
    monkeypatch.setattr(kernel_check, "_on_accelerator", lambda: True)
    model = model_with(wrong_scale, write_kv)
    llm = LLM(model, model_config=CFG, block_size=16, num_kv_blocks=16, warm_up=False, progress=False,
              data_parallel_size=2)
    assert llm.kernel_check.status == "failed"
    replicas = [model, *llm._module_copies]
    assert len(replicas) == 2 and all(m.layers.self_attn.attention_fn.inner is paged_attention_tiled for m in replicas)
