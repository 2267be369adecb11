"""min_tokens masks the stop tokens (EOS unless ignore_eos, stop_token_ids) in the logits until a
sequence has that many output tokens: greedy output is transformers' ``generate(min_new_tokens=k)``
token for token, sampled rows never draw a stop token early (even one biased to be certain),
logprobs are those of the masked distribution, speculative decoding gives the same tokens as
without it, beam search is transformers' with ``min_new_tokens``, and a grammar combines with
the mask (tiny random Llama with a byte tokenizer, EOS 256)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxengine import LLM, BeamSearchParams, SamplingParams
from jaxengine.core.scheduler_output import NewSequenceData, SchedulerOutput
from jaxengine.runner.input_batch import InputBatch
from jaxengine.sampling_params import StructuredOutputsParams
from tests.helpers import every_draft_goes

EOS = 256
MIN = 3
# One step bucket: each engine compiles one step.
OPTIONS = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=4, max_model_len=128, num_kv_blocks=80,
               token_buckets=[32], request_buckets=[8], progress=False, compile_mode="eager")
PROMPTS = [[72, 105, 33], [5, 9, 200, 13, 77], [100], [40, 41, 40, 41, 40, 41]]


@pytest.fixture(scope="module")
def hf(chat_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(chat_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    return LLM(chat_checkpoint, **OPTIONS)


def reference(hf, prompt, eos, max_tokens, min_tokens=0, bias=None):
    """transformers' greedy tokens up to and including EOS."""
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=min_tokens,
                          do_sample=False, pad_token_id=0, sequence_bias=bias)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def generate(llm, prompts, params):
    with llm.runner.forbid_compiles():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks and not llm.engine.has_unfinished_requests()
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def finish(tokens, eos, max_tokens):
    return (tokens, "stop" if tokens[-1] == eos and len(tokens) <= max_tokens else "length")


def test_greedy_matches_transformers_min_new_tokens_with_a_stop_token_first(hf, llm):
    """The stop token is the first prompt's greedy first token: alone it ends that output at once;
    with min_tokens the output goes on as transformers' does, in a batch with a row without."""
    stop = reference(hf, PROMPTS[0], None, 1)[0]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert generate(llm, PROMPTS[:1], plain) == [[([stop], "stop")]]
    for min_tokens, max_tokens in ((MIN, 8), (4, 4), (1, 6)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=True,
                                stop_token_ids=[stop])
        expected = [[finish(reference(hf, p, stop, max_tokens, min_tokens), stop, max_tokens)] for p in PROMPTS]
        assert expected[0][0][0][0] != stop
        got = generate(llm, PROMPTS + PROMPTS[:1], [params] * len(PROMPTS) + [plain])
        assert got == expected + [[([stop], "stop")]]


def test_greedy_eos_biased_to_be_certain_comes_right_after_min_tokens(hf, llm):
    """The model's EOS (not ignored) with logit_bias +100: transformers with the same bias and
    min_new_tokens, and every output is min_tokens tokens then EOS."""
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=MIN, logit_bias={EOS: 100.0})
    got = generate(llm, PROMPTS, params)
    expected = [[finish(reference(hf, p, EOS, 8, MIN, bias={(EOS,): 100.0}), EOS, 8)] for p in PROMPTS]
    assert got == expected
    assert all(len(tokens) == MIN + 1 and tokens[-1] == EOS and EOS not in tokens[:-1] for (tokens, _), in got)
    assert generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, logit_bias={EOS: 100.0})) == \
        [[([EOS], "stop")]]


@pytest.mark.parametrize("knobs", [{}, dict(top_k=5), dict(top_p=0.9), dict(min_p=0.2), dict(n=2),
                                   dict(presence_penalty=0.5)])
def test_sampled_rows_never_draw_a_stop_token_before_min_tokens(llm, knobs):
    """EOS biased by +100 is drawn at the first position it may be: the (MIN + 1)-th."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, min_tokens=MIN, logit_bias={EOS: 100.0}, **knobs)
    for outs in generate(llm, PROMPTS, params):
        assert len(outs) == knobs.get("n", 1)
        for tokens, reason in outs:
            assert EOS not in tokens[:MIN] and tokens[MIN:] == [EOS] and reason == "stop"


def test_logprobs_are_those_of_the_masked_distribution(hf, llm):
    """Before min_tokens the top logprobs are transformers' logits renormalised without EOS;
    after it EOS (biased to be certain) is the top one."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, logprobs=4, logit_bias={EOS: 100.0})
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == EOS
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:1]])).logits[0, -2:]
    logits[:, EOS] = -torch.inf
    expected = torch.log_softmax(logits, -1)
    for position in (0, 1):
        top = expected[position].topk(4)
        got = out.logprobs[position]
        assert EOS not in got and list(got)[:4] == top.indices.tolist()
        assert [got[t] for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert got[out.token_ids[position]] == pytest.approx(expected[position, out.token_ids[position]].item(),
                                                             abs=1e-4)
    assert max(out.logprobs[2], key=out.logprobs[2].get) == EOS and out.logprobs[2][EOS] == pytest.approx(0, abs=1e-4)


def beam_reference(hf, prompt, width, eos, max_tokens, min_tokens=0):
    """transformers' hypotheses: (output tokens up to and including EOS, score)."""
    hf.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=max_tokens, min_new_tokens=min_tokens, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    hypotheses = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        hypotheses.append((row[:row.index(eos) + 1] if eos in row else row, score))
    return hypotheses


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers_min_new_tokens(hf, llm, width):
    """The stop token is the first prompt's third greedy token: without min_tokens a hypothesis
    ends with it by then; with min_tokens none ends before, others end with it later, scored as
    transformers scores them (the mask takes the stop tokens out of the candidates without
    raising the others' scores)."""
    stop = reference(hf, PROMPTS[0], None, MIN)[-1]
    prompts = PROMPTS[:2]
    assert any(len(tokens) <= MIN and tokens[-1] == stop for tokens, _ in beam_reference(hf, PROMPTS[0], width, stop, 6))
    expected = [beam_reference(hf, p, width, stop, 6, MIN) for p in prompts]
    assert any(len(tokens) > MIN and tokens[-1] == stop for hyps in expected for tokens, _ in hyps)
    with llm.runner.forbid_compiles():
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=width, max_tokens=6, min_tokens=MIN, ignore_eos=True,
                                                stop_token_ids=[stop]))
    got = [[(s.tokens[len(p):], s.score) for s in out.sequences] for p, out in zip(prompts, outs)]
    assert [[tokens for tokens, _ in hyps] for hyps in got] == [[tokens for tokens, _ in hyps] for hyps in expected]
    for hyps, ref in zip(got, expected):
        assert [score for _, score in hyps] == pytest.approx([score for _, score in ref], rel=1e-5, abs=1e-4)
        assert all(stop not in tokens[:MIN] for tokens, _ in hyps)


def test_a_grammar_and_min_tokens_combine(llm):
    """EOS biased to be certain ends a regex's output as soon as the grammar allows it; with
    min_tokens, letters come until then. A constraint complete before min_tokens still ends."""
    regex = dict(regex="[a-z]+")
    texts = []
    for min_tokens in (0, 5):
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=min_tokens, logit_bias={EOS: 100.0},
                                structured_outputs=StructuredOutputsParams(**regex))
        out = llm.generate(["Word:"], params, use_tqdm=False)[0].outputs[0]
        texts.append((len(out.token_ids), out.token_ids[-1], out.finish_reason, len(out.text)))
    assert texts == [(2, EOS, "stop", 1), (6, EOS, "stop", 5)]
    choice = SamplingParams(temperature=0, max_tokens=12, min_tokens=8, logit_bias={EOS: 100.0},
                            structured_outputs=StructuredOutputsParams(choice=["abc", "xyz"]))
    out = llm.generate(["Pick:"], choice, use_tqdm=False)[0].outputs[0]
    assert out.text in ("abc", "xyz") and out.finish_reason == "stop"


def test_speculative_decoding_gives_the_same_tokens(chat_checkpoint, llm):
    """Prompts of A and the stop token alternating, A and the stop token biased to be certain: the
    n-gram proposer drafts the stop token after each A, which the target refuses until
    min_tokens and takes at once after (each position sampled under its own mask), so the
    outputs are A x min_tokens, then the stop token, with drafts as without; and seeded sampling
    with a likely stop token is the same with drafts as without."""
    spec = every_draft_goes(LLM(chat_checkpoint, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, **OPTIONS))
    spec.engine.traces = []
    a, stop, min_tokens = 50, 131, 4
    prompts = [[a, stop, a, stop, a], [a, stop, a, stop, a, stop, a, stop]]
    for knobs in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        p = SamplingParams(max_tokens=8, min_tokens=min_tokens, ignore_eos=True, stop_token_ids=[stop],
                           logit_bias={stop: 100.0, a: 50.0}, **knobs)
        assert generate(spec, prompts, p) == generate(llm, prompts, p) == [[([a] * min_tokens + [stop], "stop")]] * 2
    traces = spec.engine.traces
    assert sum(t.num_draft_tokens for t in traces) > sum(t.num_accepted_tokens for t in traces) > 0
    prompts = [[40, 41, 40, 41, 40, 41], [7, 8, 9, 7, 8, 9, 7, 8]]
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=10, min_tokens=min_tokens, ignore_eos=True,
                       stop_token_ids=[9, stop], logit_bias={9: 5.0, stop: 5.0})
    got = generate(spec, prompts, p)
    assert got == generate(llm, prompts, p) and all(t not in tokens[:min_tokens] for (tokens, _), in got for t in (9, stop))


def test_the_batch_masks_each_sample_row_until_its_min_tokens():
    """A decode row with 3 drafts crossing min_tokens (its positions 2, 3, 4, 5 against 4), a
    fork of 2 at position 0, a beam's row and a row without min_tokens; stop ids 1, 33, 40."""
    batch = InputBatch(4, 32, 8, 4, [16], [8], vocab_size=64)

    def new(seq_id, tokens, num_prompt, stops, beam=False, **params):
        return NewSequenceData(seq_id, f"r{seq_id}", tokens, [seq_id], SamplingParams(**params), 0, 7, num_prompt,
                               stops, beam)

    out = SchedulerOutput(
        seq_ids=[10, 11, 12, 13], num_scheduled_tokens=[4, 3, 1, 1], num_samples=[4, 2, 1, 1],
        num_computed_tokens=[4, 0, 5, 5], previous_sample_rows=[-1] * 4, draft_token_ids={10: [5, 6, 7]},
        new_seqs=[new(10, [1, 2, 3, 4, 9], 3, (1, 33), min_tokens=4),
                  new(11, [1, 2, 3], 3, (40,), n=2, min_tokens=1),
                  new(12, [1, 2, 3, 4, 5, 6], 4, (1, 40), beam=True, min_tokens=3),
                  new(13, [1, 2, 3, 4, 5, 6], 4, (1,))])
    batch.update(out)
    sm = batch.prepare(out)[0].sampling
    assert sm.step[:8].tolist() == [2, 3, 4, 5, 0, 0, 2, 2]
    assert sm.masks_stops.tolist() == [True, True, False, False, True, True, True, False]
    assert sm.beam_scores.tolist() == [False] * 6 + [True, False]
    expected = np.zeros((8, 2), np.uint32)
    expected[:2] = [1 << 1, 1 << 1]                 # token 1: word 0 bit 1; token 33: word 1 bit 1
    expected[4:6, 1] = 1 << 8                       # token 40
    expected[6] = [1 << 1, 1 << 8]
    assert np.asarray(sm.stop_bitmask).view(np.uint32).tolist() == expected.tolist()
    # Without any row under min_tokens: the device's zeros, as for a step without logit bias.
    plain = SchedulerOutput(seq_ids=[13], num_scheduled_tokens=[1], num_samples=[1], num_computed_tokens=[6],
                            previous_sample_rows=[-1])
    sm = batch.prepare(plain)[0].sampling
    assert isinstance(sm.stop_bitmask, jax.Array) and not sm.masks_stops.any()


def test_a_row_whose_grammar_allows_only_stop_tokens_keeps_them():
    """The mask would leave nothing: the grammar's stop token comes (the constraint is complete)."""
    from jaxengine.sample.metadata import SamplingMetadata
    from jaxengine.sample.sampler import sample

    rows = 2
    md = SamplingMetadata(
        temperature=jnp.zeros(rows), top_p=jnp.ones(rows), top_k=jnp.zeros(rows, jnp.int32), min_p=jnp.zeros(rows),
        seed=jnp.zeros((rows, 2), jnp.uint32), sample_index=jnp.zeros(rows, jnp.int32),
        step=jnp.zeros(rows, jnp.int32), want_logprobs=jnp.ones(rows, bool), presence_penalty=jnp.zeros(rows),
        frequency_penalty=jnp.zeros(rows), repetition_penalty=jnp.ones(rows), history=jnp.zeros((rows, 1), jnp.int32),
        num_prompt=jnp.zeros(rows, jnp.int32), num_history=jnp.zeros(rows, jnp.int32),
        bias_ids=jnp.zeros((rows, 1), jnp.int32), bias_values=jnp.zeros((rows, 1)), logprobs_temperature=jnp.ones(rows),
        token_bitmask=jnp.asarray([[0b0110], [-1]], jnp.int32), constrained=jnp.ones(rows, bool),
        stop_bitmask=jnp.asarray([[0b0110], [0b0110]], jnp.int32), masks_stops=jnp.ones(rows, bool),
        beam_scores=jnp.zeros(rows, bool))
    logits = jnp.asarray([[0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 3.0, 2.0]])
    out = jax.jit(sample, static_argnums=2)(logits, md, 2)
    assert out.token_ids.tolist() == [2, 3]
    assert out.top_token_ids.tolist() == [[2, 1], [3, 0]]
