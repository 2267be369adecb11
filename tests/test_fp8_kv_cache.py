"""The FP8 KV cache (--kv-cache-dtype fp8): a pool of twice the tokens of bfloat16 in the same
memory, logits near the f32 cache's, the checkpoint's per-layer K/V scales read and applied, and
the engine serving with it."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxengine import LLM, SamplingParams
from jaxengine.engine_args import EngineArgs
from jaxengine.models.weights import load_model

from tests.conftest import make_checkpoint
from tests.models.test_llama_vs_transformers import PROMPTS, run_chunks
from tests.models.test_stored_quantization import fp8_blocks, linears, write


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8kv")
    return folder, make_checkpoint(folder, "llama")


def test_the_fp8_pool_holds_twice_the_tokens_of_bfloat16_in_the_same_memory(llama):
    _, cfg = load_model(llama[0])
    blocks = {}
    for kv in ("auto", "fp8"):
        args = EngineArgs(dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_bytes=64 << 20)
        blocks[kv] = args.create_engine_config(cfg, args.resolve_kv_dtype(jnp.bfloat16)).cache.num_gpu_blocks
    assert args.resolve_kv_dtype(jnp.bfloat16) == jnp.float8_e4m3fn
    assert blocks["fp8"] == 2 * blocks["auto"]
    with pytest.raises(ValueError, match=r"kv_cache_dtype: must be one of \['auto', 'fp8'\], got 'int8'"):
        EngineArgs(kv_cache_dtype="int8")


def assert_near_the_f32_cache(model, cfg, ids):
    """e4m3 keeps 3 mantissa bits, bfloat16 7: the FP8 cache's logits are off by about 16 times
    the bfloat16 cache's (mean |delta| 0.1-0.3 on logits of mean |l| 2 from this model's large
    random weights; a cache read wrongly is off by the logits' own size)."""
    f32 = run_chunks(model, cfg, ids, [len(ids)])
    fp8 = run_chunks(model, cfg, ids, [3, len(ids) - 3], kv_dtype=jnp.float8_e4m3fn)   # reads what it wrote
    bf16 = run_chunks(model, cfg, ids, [3, len(ids) - 3], kv_dtype=jnp.bfloat16)
    err, err16 = np.abs(fp8 - f32).mean(), np.abs(bf16 - f32).mean()
    assert err < 0.4 and err < 30 * err16, (err, err16)
    assert (fp8.argmax(-1) == f32.argmax(-1)).mean() >= 0.7


def test_fp8_cache_logits_stay_near_the_f32_caches(llama):
    model, cfg = load_model(llama[0])
    assert_near_the_f32_cache(model, cfg, PROMPTS[3])


def test_the_checkpoints_kv_scales_are_read_per_layer_and_applied(llama, tmp_path):
    folder, hf_model = llama
    replaced = {}
    for name, w in linears(hf_model):
        q, s, _ = fp8_blocks(w, (32, 32))
        replaced[name[:-len(".weight")]] = {"weight": q, "weight_scale_inv": s}
    scales = {}
    for layer in range(2):              # stored as [] (one layer) and [1] (the other): both read
        k_scale, v_scale = 0.05 * (layer + 1), 0.04 * (layer + 1)
        attention = f"model.layers.{layer}.self_attn"
        replaced[attention] = {"k_scale": torch.tensor(k_scale).reshape([] if layer else [1]),
                               "v_scale": torch.tensor(v_scale)}
        scales[layer] = (k_scale, v_scale)
    quantized = write(tmp_path / "fp8", hf_model, replaced, {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                              "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    model, cfg = load_model(quantized)
    assert cfg.kv_scales
    np.testing.assert_allclose(np.asarray(model.layers.self_attn.k_scale[...])[:, 0], [0.05, 0.1], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.layers.self_attn.v_scale[...])[:, 0], [0.04, 0.08], rtol=1e-6)
    # the cache holds k / k_scale and attention multiplies it back: the logits as with no scales
    assert_near_the_f32_cache(model, cfg, PROMPTS[2])


def test_the_engine_serves_with_an_fp8_cache(llama):
    folder, _ = llama
    options = dict(skip_tokenizer_init=True, max_num_batched_tokens=32, max_model_len=64, num_kv_blocks=32,
                   max_num_seqs=4, token_buckets=[32], request_buckets=[4], progress=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS[1:]]
    plain = LLM(folder, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(folder, kv_cache_dtype="fp8", **options)
    assert llm.runner.kv_caches[0].dtype == jnp.uint8          # float8_e4m3fn bytes: the CPU writes them in place
    fp8 = llm.generate(prompts, params, use_tqdm=False)
    same = [a.outputs[0].token_ids[:2] == b.outputs[0].token_ids[:2] for a, b in zip(plain, fp8)]
    assert all(len(o.outputs[0].token_ids) == 8 for o in fp8) and sum(same) >= 2


def test_the_pallas_kernels_serve_the_cpus_fp8_bytes_as_the_plain_jnp_path_does(llama):
    """The CPU stores an FP8 cache as its bytes: the Pallas attention kernel and KV write
    (interpreted) read and write them as float8, so greedy decoding gives the plain-jnp path's tokens."""
    from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas
    from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas

    folder, _ = llama
    options = dict(skip_tokenizer_init=True, max_num_batched_tokens=32, max_model_len=64, num_kv_blocks=32,
                   max_num_seqs=4, token_buckets=[32], request_buckets=[4], progress=False, compile_mode="eager",
                   kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS[1:]]
    tokens = {}
    for backend in ("auto", "pallas"):
        llm = LLM(folder, attention_backend=backend, **options)
        assert llm.runner.kv_caches[0].dtype == jnp.uint8
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.model.layers.self_attn.attention_fn.inner is paged_attention_pallas
    # The Pallas KV write too, in place of the XLA scatter (the engine picks it on a GPU that measures it faster).
    model, cfg = load_model(folder, attention_fn=paged_attention_pallas)
    model.layers.self_attn.kv_write_fn = write_kv_pallas
    llm = LLM(model, model_config=cfg, **{k: v for k, v in options.items() if k != "skip_tokenizer_init"})
    tokens["pallas write"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["pallas"] == tokens["auto"] and tokens["pallas write"] == tokens["auto"]
    assert [len(t) for t in tokens["auto"]] == [6] * len(prompts)
