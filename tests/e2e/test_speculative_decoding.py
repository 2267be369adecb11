"""Speculative decoding (n-gram) on a tiny model: the same tokens as without it, greedy and seeded
sampling alike, n > 1 groups, logprobs, stop strings and max_tokens inside an accepted run,
preemption on a tiny pool and prefix-cache hits; drafts are proposed and accepted; no
compilation after start-up; the step traces count drafts; bad options name their field."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams
from tests.helpers import every_draft_goes
from jaxengine.sampling_params import BeamSearchParams

# Two step buckets, not the defaults' 24: each compiles at start-up.
OPTIONS = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=4, max_model_len=128, swap_space=0.002,
               token_buckets=[16, 32], request_buckets=[8], progress=False, compile_mode="eager")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# Byte-level prompts that repeat themselves, so prompt lookup finds n-grams; the tiny random model
# falls into loops of its own, which it then also finds.
PROMPTS = ["abcabcabcab", "the cat saw the cat and the", "xyz", "0101010101"]


@pytest.fixture(scope="module")
def engines(chat_checkpoint):
    """(without speculation, with it), same checkpoint and options; the second with a pool small
    enough to preempt."""
    plain = LLM(chat_checkpoint, num_kv_blocks=60, **OPTIONS)
    spec = LLM(chat_checkpoint, num_kv_blocks=60, speculative_config=SPEC, **OPTIONS)
    spec.engine.traces = []                 # keep every step's record
    # Every draft proposed goes (the gate would switch speculation off on a random model, whose
    # drafts are seldom accepted): these tests are about the outputs with drafts.
    every_draft_goes(spec)
    return plain, spec


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason) for c in r.outputs] for r in llm.generate(prompts, params,
                                                                                                use_tqdm=False)]


def test_greedy_and_seeded_sampling_give_the_same_outputs_and_drafts_are_accepted(engines):
    plain, spec = engines
    spec.engine.traces.clear()
    with spec.engine.runner.forbid_compiles():
        for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                       SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True),
                       SamplingParams(temperature=0.8, top_k=20, seed=3, n=2, max_tokens=25, ignore_eos=True)):
            assert outputs(spec, PROMPTS, params) == outputs(plain, PROMPTS, params)
    traces = spec.engine.traces
    drafted, accepted = sum(t.num_draft_tokens for t in traces), sum(t.num_accepted_tokens for t in traces)
    assert drafted > 0 and accepted > 0
    assert accepted == sum(sum(t.accepted_per_position) for t in traces)
    assert all(t.num_accepted_tokens <= t.num_draft_tokens for t in traces)


@settings(max_examples=10, deadline=None)
@given(prompts=st.lists(st.text("abc ", min_size=1, max_size=24), min_size=1, max_size=5), k=st.integers(1, 3),
       max_tokens=st.integers(1, 30), n=st.sampled_from([1, 1, 2]), seed=st.none() | st.integers(0, 99),
       stop_token=st.none() | st.integers(97, 99))
def test_random_workloads_give_the_same_outputs(engines, prompts, k, max_tokens, n, seed, stop_token):
    """Prompts of a 4-letter alphabet (n-grams recur), k from 1 to 3, max_tokens anywhere in an
    accepted run, n > 1, greedy or seeded sampling, a stop token ("a", "b" or "c")."""
    from jaxengine.spec_decode.ngram import NgramProposer

    plain, spec = engines
    spec.engine.runner.ngram = NgramProposer(k, SPEC.get("prompt_lookup_max", 4), SPEC["prompt_lookup_min"])
    params = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed, max_tokens=max_tokens, n=n,
                            stop_token_ids=[] if stop_token is None else [stop_token])
    try:
        assert outputs(spec, prompts, params) == outputs(plain, prompts, params)
    finally:
        spec.engine.runner.ngram = NgramProposer(SPEC["num_speculative_tokens"], 4, SPEC["prompt_lookup_min"])


def test_penalties_are_computed_per_draft_position(engines):
    """Each draft position's penalties count the tokens before it (the drafts included), as that
    position's would without speculation."""
    plain, spec = engines
    before = sum(t.num_draft_tokens for t in spec.engine.traces)
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
                   SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=0.6,
                                  frequency_penalty=0.3)):
        assert outputs(spec, PROMPTS, params) == outputs(plain, PROMPTS, params)
    assert sum(t.num_draft_tokens for t in spec.engine.traces) > before


def test_logprobs_stop_strings_and_max_tokens_end_where_they_would(engines):
    plain, spec = engines
    for params in (SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=60, stop=["ca", "01"], ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=60)):
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        want = plain.generate(PROMPTS, params, use_tqdm=False)
        for g, w in zip(got, want):
            (gc,), (wc,) = g.outputs, w.outputs
            assert (gc.token_ids, gc.text, gc.finish_reason) == (wc.token_ids, wc.text, wc.finish_reason)
            if params.logprobs:
                assert len(gc.logprobs) == len(gc.token_ids) == 7
                for a, b in zip(gc.logprobs, wc.logprobs):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_preemption_and_prefix_hits_change_nothing_and_free_every_block(engines):
    plain, spec = engines
    prompts = [p * 2 for p in PROMPTS] * 2          # the repeats hit the prefix cache; 8 rows fill the pool
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = sum(t.num_preemptions for t in spec.engine.traces)
    assert outputs(spec, prompts, params) == outputs(plain, prompts, params)
    assert sum(t.num_preemptions for t in spec.engine.traces) > before
    kv = spec.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_structured_output_with_drafts_gives_the_same_outputs(engines):
    """Drafts cut to what the grammar allows, a mask per draft position, the grammar taking in the
    kept tokens one by one (a constraint complete inside an accepted run ends the output there)."""
    from jaxengine.sampling_params import StructuredOutputsParams

    plain, spec = engines
    before = sum(t.num_draft_tokens for t in spec.engine.traces)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["ab", "abab"]},
                                                        "minItems": 3, "maxItems": 5}},
              "required": ["tags"], "additionalProperties": False}
    for kind in ({"regex": "(ab|abc){3,8}x"}, {"json": schema}, {"choice": ["abcabc", "abcab", "xyz"]}):
        params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(**kind))
        assert outputs(spec, PROMPTS, params) == outputs(plain, PROMPTS, params)
    assert sum(t.num_draft_tokens for t in spec.engine.traces) > before


def test_bad_speculative_options_and_beam_search_are_refused_by_name(engines):
    _, spec = engines
    from jaxengine.engine_args import EngineArgs

    for bad, match in (({"method": "medusa"}, "speculative_config.method"),
                       ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
                       ({"k": 2}, r"speculative_config: unknown key\(s\) \['k'\]")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(speculative_config=bad)
    with pytest.raises(ValueError, match="speculative_config: beam search"):
        spec.beam_search(["abc"], BeamSearchParams(beam_width=2, max_tokens=4))


def test_the_server_streams_speculative_outputs_as_the_engine_without_it_writes_them(engines):
    """Last in this module: the speculating engine then serves (its offline use is over)."""
    import httpx

    from tests.serve.live import serving, stream_texts

    plain, spec = engines
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0.0, "n": 2, "seed": 5,
            "stop": ["saw a"]}
    want = plain.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=40, n=2, seed=5,
                                                       stop=["saw a"]), use_tqdm=False)[0]
    with serving(spec) as url:
        texts, finish = stream_texts(url, "completions", body)
        metrics = httpx.get(f"{url}/metrics").text
    assert texts == {i: c.text for i, c in enumerate(want.outputs)}
    assert finish == {i: c.finish_reason for i, c in enumerate(want.outputs)}
    drafted = [line for line in metrics.splitlines() if line.startswith("jaxengine:spec_decode_num_draft_tokens")]
    assert drafted and float(drafted[0].split()[-1]) > 0
