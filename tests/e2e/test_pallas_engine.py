"""End to end: the engine's greedy output with the Pallas kernel (interpret mode on the CPU)
equals the plain-jnp path's, with chunked prefill, decodes and a sliding window in the batch.
One step bucket per engine: an interpreted kernel is slow to compile."""
import pytest

from jaxengine import SamplingParams
from tests.conftest import VARIANTS, make_checkpoint

PROMPTS = [[5, 17, 99, 3, 42] * 7, [1, 2, 3], list(range(40, 90)), [200, 201]]


@pytest.mark.parametrize("variant", ["llama", "mistral-window"])
def test_pallas_backend_generates_what_the_reference_does(tmp_path, variant):
    from jaxengine.llm import LLM

    model_type, overrides = VARIANTS[variant]
    make_checkpoint(tmp_path, model_type, **overrides)
    engine = dict(skip_tokenizer_init=True, block_size=16, max_num_batched_tokens=32, max_num_seqs=4,
                  max_model_len=128, num_kv_blocks=40, token_buckets=[32], request_buckets=[4], progress=False, compile_mode="eager")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "pallas"):
        llm = LLM(tmp_path, attention_backend=backend, **engine)
        with llm.runner.forbid_compiles():
            outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs["pallas"] == outputs["reference"]
    assert all(len(t) == 10 for t in outputs["pallas"])


def test_mosaic_kernel_generates_what_the_triton_kernel_does(tmp_path):
    """bf16 (the Mosaic GPU kernel takes 16-bit caches), head size 64: the Hopper kernel,
    interpreted, against the Triton-lowered one, which rounds P to bf16 the same way."""
    import jax

    from jaxengine.llm import LLM
    from tests.kernels.mosaic_interpret import transposed_wgmma_operands

    if jax.devices()[0].platform != "cpu" and not str(jax.devices()[0].compute_capability).startswith("9."):
        pytest.skip("the Mosaic GPU kernel runs on sm_90 or interpreted")
    make_checkpoint(tmp_path, "llama", head_dim=64)
    engine = dict(skip_tokenizer_init=True, block_size=16, max_num_batched_tokens=32, max_num_seqs=4,
                  max_model_len=128, num_kv_blocks=40, token_buckets=[32], request_buckets=[4], progress=False, dtype="bfloat16",
                  compile_mode="eager")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    with transposed_wgmma_operands():
        for backend in ("pallas-triton", "pallas-mosaic"):
            llm = LLM(tmp_path, attention_backend=backend, **engine)
            outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs["pallas-mosaic"] == outputs["pallas-triton"]
    assert all(len(t) == 6 for t in outputs["pallas-mosaic"])


def test_pallas_kv_write_generates_what_the_scatter_does():
    """The Pallas KV write (interpreted) in place of the XLA scatter, in the whole engine: the same
    greedy tokens and logprobs, with prefills, chunks and decodes writing into the cache."""
    from flax import nnx

    from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas
    from jaxengine.llm import LLM
    from jaxengine.models.config import ModelConfig
    from jaxengine.models.llama import LlamaForCausalLM

    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    engine = dict(model_config=cfg, block_size=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128,
                  num_kv_blocks=40, token_buckets=[32], request_buckets=[4], progress=False, compile_mode="eager")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outputs = {}
    for name, writer in (("scatter", model.layers.self_attn.kv_write_fn), ("pallas", write_kv_pallas)):
        model.layers.self_attn.kv_write_fn = writer
        llm = LLM(model, **engine)
        outputs[name] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                         for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs["pallas"] == outputs["scatter"]
