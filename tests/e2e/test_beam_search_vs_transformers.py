"""Beam search through the whole engine is transformers' beam search token for token (tiny random
checkpoints): every architecture at widths 2, 4 and 8, with and without an EOS among the
candidates, the length penalty and early-stopping rules, and whatever the scheduling (tiny
budget, tiny pool with swap or recompute, prefix caching, async scheduling, ordinary requests
in the same steps). The pool is whole when everything ends."""
from collections import Counter

import numpy as np
import pytest
import torch

from jaxengine import LLM, BeamSearchParams, SamplingParams

MAX_TOKENS = 8
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, 256, n).tolist() for n in (1, 6, 13, 21)]


def reference(hf_model, prompt, width, eos=None, max_tokens=MAX_TOKENS, length_penalty=1.0, early_stopping=False):
    """transformers' k best hypotheses: (output tokens up to and including EOS, score)."""
    hf_model.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                                max_new_tokens=max_tokens, length_penalty=length_penalty,
                                early_stopping=early_stopping, pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True)
    hypotheses = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        hypotheses.append((row, score))
    return hypotheses


def engine(folder, **options):
    """One step bucket (the limits themselves): an engine compiles one step, not nine."""
    base = dict(skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=32, block_size=4,
                max_model_len=64, num_kv_blocks=256, swap_space=0.01, progress=False, compile_mode="eager")
    merged = {**base, **options}
    return LLM(folder, token_buckets=[merged["max_num_batched_tokens"]], request_buckets=[merged["max_num_seqs"]],
               **merged)


def beam_search(llm, prompts, width, eos=None, **params):
    """The engine's hypotheses per prompt; EOS given as a stop token (the tiny config's own EOS
    ignored), as transformers is given it."""
    p = BeamSearchParams(beam_width=width, max_tokens=params.pop("max_tokens", MAX_TOKENS), ignore_eos=True,
                         stop_token_ids=[] if eos is None else [eos], **params)
    with llm.runner.forbid_compiles():
        outs = llm.beam_search(prompts, p)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks and not llm.engine.has_unfinished_requests()
    return [[(s.tokens[len(prompt):], s.score) for s in out.sequences] for prompt, out in zip(prompts, outs)]


def assert_same(got, expected):
    assert [[tokens for tokens, _ in hyps] for hyps in got] == [[tokens for tokens, _ in hyps] for hyps in expected]
    for hyps, ref in zip(got, expected):
        assert [score for _, score in hyps] == pytest.approx([score for _, score in ref], rel=1e-5, abs=1e-4)


def eos_among_candidates(hf_model, width: int) -> tuple[int, list]:
    """An EOS that the beams meet: of the tokens the hypotheses without one hold most often, the
    first with which transformers ends some hypothesis early; (it, transformers' hypotheses)."""
    counts = Counter(t for p in PROMPTS for tokens, _ in reference(hf_model, p, width) for t in tokens[1:-1])
    for eos, _ in counts.most_common(8):
        expected = [reference(hf_model, p, width, eos=eos) for p in PROMPTS]
        if any(tokens[-1] == eos and len(tokens) < MAX_TOKENS for hyps in expected for tokens, _ in hyps):
            return eos, expected
    raise AssertionError("no EOS candidate ends a hypothesis early")


def test_every_architecture_matches_transformers_beam_search(checkpoint):
    _, folder, hf_model = checkpoint
    llm = engine(folder)
    for width in (2, 4, 8):
        assert_same(beam_search(llm, PROMPTS, width), [reference(hf_model, p, width) for p in PROMPTS])
        eos, expected = eos_among_candidates(hf_model, width)          # some hypotheses end early with it
        assert_same(beam_search(llm, PROMPTS, width, eos=eos), expected)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("llama-beam")
    hf = make_checkpoint(folder, "llama")
    return folder, hf, eos_among_candidates(hf, 4)[0]


@pytest.fixture(scope="module")
def llama_engine(llama):
    """One engine with the default options for the tests that vary only the search."""
    return engine(llama[0])


@pytest.mark.parametrize("length_penalty, early_stopping", [(0.0, "never"), (2.0, "never"), (-1.0, False),
                                                            (1.0, True), (2.0, False)])
def test_length_penalty_and_early_stopping_rules(llama, llama_engine, length_penalty, early_stopping):
    _, hf_model, eos = llama
    rules = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    expected = [reference(hf_model, p, 4, eos=eos, max_tokens=12, **rules) for p in PROMPTS]
    assert_same(beam_search(llama_engine, PROMPTS, 4, eos=eos, max_tokens=12, **rules), expected)


@pytest.mark.parametrize("name, options", [
    ("tiny budget: chunked prefill", dict(max_num_batched_tokens=8, max_num_seqs=8)),
    ("tiny pool: swap", dict(num_kv_blocks=24, preemption_mode="auto", enable_prefix_caching=False)),
    # recompute gives each beam its own copy of the prompt again: the pool holds one group so
    ("tiny pool: recompute", dict(num_kv_blocks=34, preemption_mode="recompute", enable_prefix_caching=False)),
    ("prefix caching", dict(enable_prefix_caching=True)),
    ("async scheduling", dict(async_scheduling=True)),
    ("async: tiny pool, swap", dict(num_kv_blocks=24, preemption_mode="auto", async_scheduling=True,
                                    enable_prefix_caching=False)),
])
def test_scheduling_never_changes_the_hypotheses(llama, name, options):
    folder, hf_model, eos = llama
    expected = [reference(hf_model, p, 4, eos=eos) for p in PROMPTS]
    llm = engine(folder, **options)
    llm.engine.traces = []                      # keep every step's record
    assert_same(beam_search(llm, PROMPTS, 4, eos=eos), expected)
    traces = llm.engine.traces
    if "tiny pool" in name:                     # the groups were preempted, whole
        assert sum(t.num_preemptions for t in traces) > 0
        swapped = sum(t.num_blocks_swapped_out for t in traces)
        assert swapped > 0 if "swap" in name else swapped == 0
    if name == "prefix caching":                # again: the prompts' full blocks are cached now
        first_run = len(traces)
        assert_same(beam_search(llm, PROMPTS, 4, eos=eos), expected)
        assert sum(t.num_prefix_hit_tokens for t in traces[first_run:]) > 0


def test_beams_and_ordinary_requests_share_steps(llama, llama_engine):
    _, hf_model, eos = llama
    llm = llama_engine
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ordinary = [llm.engine.add_request(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    expected = [reference(hf_model, p, 4, eos=eos) for p in PROMPTS]
    assert_same(beam_search(llm, PROMPTS, 4, eos=eos), expected)
    hf_model.generation_config.eos_token_id = None
    for request, prompt in zip(ordinary, PROMPTS):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        assert request.seqs[0].output_token_ids == ref[0, len(prompt):].tolist()


def test_temperature_scores_candidates_at_that_temperature(llama, llama_engine):
    """log_softmax(logits / T) is the distribution of the same model with its output layer
    scaled by 1 / T: transformers' beam search on that model is the reference."""
    import copy

    _, hf_model, eos = llama
    scaled = copy.deepcopy(hf_model)
    with torch.no_grad():
        scaled.lm_head.weight /= 2.0
    expected = [reference(scaled, p, 4, eos=eos) for p in PROMPTS]
    got = beam_search(llama_engine, PROMPTS, 4, eos=eos, temperature=2.0)
    assert_same(got, expected)
    at_one = [reference(hf_model, p, 4, eos=eos) for p in PROMPTS]
    assert [[t for t, _ in h] for h in got] != [[t for t, _ in h] for h in at_one]     # the temperature mattered
