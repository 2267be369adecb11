"""DeepSeek-V3 (latent attention over the paged cache of latents, grouped sigmoid routing with a
score-correction bias, a dense first layer, ungated shared experts) through the whole engine is
token-for-token transformers' greedy `generate`: as it comes, with chunked prefill, preemption
in a tiny pool (recompute and swap) and prefix caching, in both forms of attention, split over
two devices by heads or by experts; its beam search is transformers', and structured output
holds on it."""
import pytest

from tests.conftest import DEEPSEEK_VARIANTS, make_deepseek_checkpoint
from tests.e2e.test_generate_vs_transformers import PROMPTS, engine, greedy, greedy_under_pressure, reference


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """variant -> (folder, the greedy tokens transformers gives for PROMPTS), each built once."""
    built = {}

    def variant(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(f"deepseek-{name}")
            built[name] = folder, reference(make_deepseek_checkpoint(folder, name), PROMPTS)
        return built[name]
    return variant


@pytest.mark.parametrize("name", sorted(DEEPSEEK_VARIANTS))
def test_deepseek_v3_matches_transformers_generate(deepseek, name):
    folder, expected = deepseek(name)
    llm = engine(folder, async_scheduling=True)
    assert llm.model_config.is_mla and llm.model_config.dense_layers == (0,)
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected, name


@pytest.mark.parametrize("name", sorted(DEEPSEEK_VARIANTS))
def test_chunks_preemption_and_the_prefix_cache_change_no_token(deepseek, name):
    folder, expected = deepseek(name)
    greedy_under_pressure(folder, expected, name)


def test_swapped_groups_come_back_with_their_latents(deepseek):
    folder, expected = deepseek("no-q-lora")
    llm = engine(folder, num_kv_blocks=14, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    llm.engine.traces = []
    outs = greedy(llm, PROMPTS, n=2)
    assert sum(t.num_blocks_swapped_out for t in llm.engine.traces) > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]


def test_the_decompressed_form_gives_the_same_tokens(deepseek):
    folder, expected = deepseek("q-lora-yarn")
    llm = engine(folder, latent_attention_form="decompressed", max_num_batched_tokens=8)
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=2),
                                     dict(tensor_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "ep2"])
def test_tensor_and_expert_parallel_give_the_same_tokens(deepseek, options):
    folder, expected = deepseek("q-lora-yarn")
    llm = engine(folder, **options)
    layer = llm.model.layers.self_attn
    assert layer.kv_b_proj[...].sharding.spec[2] == "model"              # [L, R, N, Dn + Dv]: split by heads
    assert llm.runner.kv_caches[0].sharding.is_fully_replicated          # every device holds every latent
    experts = llm.model.sparse_mlp.experts.gate_proj[...].sharding.spec    # [L, E, D, F]: whole experts or width
    assert (experts[1], experts[3]) == (("model", None) if "enable_expert_parallel" in options else (None, "model"))
    outs = greedy(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_beam_search_matches_transformers(tmp_path):
    from tests.e2e import test_beam_search_vs_transformers as beams

    hf = make_deepseek_checkpoint(tmp_path, "no-q-lora")
    expected = [beams.reference(hf, prompt, 4) for prompt in beams.PROMPTS]
    llm = beams.engine(tmp_path, num_kv_blocks=24, swap_space=0.01)        # tight: groups swap out and back
    llm.engine.traces = []
    beams.assert_same(beams.beam_search(llm, beams.PROMPTS, 4), expected)
    assert sum(t.num_blocks_swapped_out for t in llm.engine.traces) > 0


def test_structured_output_holds_on_deepseek(tmp_path):
    import re

    from jaxengine import SamplingParams
    from jaxengine.sampling_params import StructuredOutputsParams
    from tests.conftest import save_byte_tokenizer

    make_deepseek_checkpoint(tmp_path, "no-q-lora", vocab_size=258, eos_token_id=256, bos_token_id=257)
    save_byte_tokenizer(tmp_path)
    llm = engine(tmp_path, skip_tokenizer_init=False)
    regex = r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(**kind))
              for kind in (dict(regex=regex), dict(choice=["alpha", "beta", "gamma"]))]
    regex_out, choice_out = (o.outputs[0].text for o in llm.generate(["Mail:", "Pick:"], params, use_tqdm=False))
    assert re.fullmatch(regex, regex_out) and choice_out in ("alpha", "beta", "gamma")
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_usable_blocks


def test_where_the_pallas_kernel_takes_no_such_head_the_plain_path_serves(deepseek):
    """The Pallas kernels take power-of-two heads; latent attention's is R + Hr (24 here, 576 for
    DeepSeek-V3), so the layer falls back to the plain-jnp path instead of failing."""
    folder, expected = deepseek("no-q-lora")
    outs = greedy(engine(folder, attention_backend="pallas"), PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == expected
