"""Speculative decoding with a draft model on tiny models: the same tokens as without it (greedy,
seeded sampling, n > 1, a pool small enough to preempt by swap and recompute); the model as its
own draft has its drafts accepted; the draft's steps compile at start-up; a draft of another
vocabulary, or none, is refused by name."""
import pytest

from jaxengine import LLM, SamplingParams
from tests.helpers import every_draft_goes

OPTIONS = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=4, max_model_len=128, swap_space=0.002,
               num_kv_blocks=50, progress=False, compile_mode="eager", token_buckets=[8, 32], request_buckets=[8])
PROMPTS = ["abcabcabcab", "the cat saw the cat and the", "xyz", "0101010101"]


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A one-layer Llama of the chat checkpoint's vocabulary and tokenizer: other weights."""
    from tests.conftest import make_checkpoint, save_byte_tokenizer

    folder = tmp_path_factory.mktemp("draft")
    make_checkpoint(folder, "llama", vocab_size=258, eos_token_id=256, bos_token_id=257, num_hidden_layers=1)
    save_byte_tokenizer(folder)
    return folder


def speculating(target, draft, k=3):
    llm = LLM(target, speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
              **OPTIONS)
    every_draft_goes(llm)
    llm.engine.traces = []
    return llm


@pytest.fixture(scope="module")
def engines(chat_checkpoint, small_draft):
    """(without speculation, the model drafting for itself, a one-layer draft)."""
    return LLM(chat_checkpoint, **OPTIONS), speculating(chat_checkpoint, chat_checkpoint), \
        speculating(chat_checkpoint, small_draft)


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason) for c in r.outputs] for r in llm.generate(prompts, params, use_tqdm=False)]


def counts(llm):
    traces = llm.engine.traces
    return sum(t.num_draft_tokens for t in traces), sum(t.num_accepted_tokens for t in traces)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
                                    SamplingParams(temperature=0.7, seed=9, n=2, max_tokens=24)],
                         ids=["greedy", "seeded", "n2"])
def test_a_draft_models_drafts_change_no_output(engines, params):
    plain, itself, small = engines
    want = outputs(plain, PROMPTS, params)
    for llm in (itself, small):
        with llm.engine.runner.forbid_compiles():
            assert outputs(llm, PROMPTS, params) == want


def test_the_model_drafting_for_itself_has_its_greedy_drafts_accepted(engines):
    plain, itself, small = engines
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for llm in (itself, small):
        llm.engine.traces.clear()
        assert outputs(llm, PROMPTS, params) == outputs(plain, PROMPTS, params)
    drafted, accepted = counts(itself)
    assert drafted > 50 and accepted >= 0.9 * drafted          # the same model: its greedy tokens
    drafted, accepted = counts(small)
    assert drafted > 50 and accepted < 0.9 * drafted
    assert itself.engine.runner.drafter.num_proposals > 0


def test_preemption_swaps_and_recomputes_both_caches(engines):
    plain, itself, _ = engines
    prompts = [p * 2 for p in PROMPTS] * 2                  # 8 rows of ~40 tokens, outputs 40: 50 blocks of 4 overflow
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=30, ignore_eos=True)):   # n=2: swapped
        itself.engine.traces.clear()
        assert outputs(itself, prompts, params) == outputs(plain, prompts, params)
        traces = itself.engine.traces
        assert sum(t.num_preemptions for t in traces) > 0 and sum(t.num_draft_tokens for t in traces) > 0
    kv = itself.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_the_pool_holds_both_caches(engines):
    plain, itself, small = engines
    per_block = [llm.engine_args.kv_bytes_per_block(llm.model_config, llm.kv_dtype, llm.draft_config)
                 for llm in (plain, itself, small)]
    assert per_block[1] == 2 * per_block[0]                        # the model twice
    assert per_block[0] < per_block[2] < per_block[1]              # plus one layer's


def test_a_draft_of_another_vocabulary_or_none_is_refused_by_name(chat_checkpoint, tmp_path):
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", vocab_size=300, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft model's vocabulary has 300 tokens"):
        LLM(chat_checkpoint, speculative_config={"method": "draft_model", "model": str(tmp_path)}, **OPTIONS)
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's checkpoint is required"):
        LLM(chat_checkpoint, speculative_config={"method": "draft_model"}, **OPTIONS)
    with pytest.raises(ValueError, match="speculative_config.model: only for methods draft_model and eagle3"):
        LLM(chat_checkpoint, speculative_config={"method": "ngram", "model": str(tmp_path)}, **OPTIONS)


def test_the_draft_model_splits_over_two_devices_as_the_model_does(engines, chat_checkpoint, small_draft):
    """Tensor parallel 2 (simulated devices): the draft sharded like the model, the same tokens."""
    plain, _, _ = engines
    tp2 = LLM(chat_checkpoint, tensor_parallel_size=2, speculative_config={
        "method": "draft_model", "model": str(small_draft), "num_speculative_tokens": 3}, **OPTIONS)
    every_draft_goes(tp2)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    assert outputs(tp2, PROMPTS, params) == outputs(plain, PROMPTS, params)
    assert tp2.engine.runner.drafter.num_proposals > 0
    assert len(tp2.engine.runner.drafter.kv_caches[0].sharding.device_set) == 2


def test_sampled_drafts_of_the_model_drafting_for_itself_are_all_but_always_kept(chat_checkpoint, engines):
    """draft_sampling "sampled": a sampling request's drafts are drawn from the draft's own
    distribution and kept with probability min(1, p/q); the model drafting for itself has q = p,
    so nearly every draft stays (greedy drafts keep only what the model's sample happens to
    repeat); greedy requests keep their outputs token for token; no compilation after start-up."""
    plain, itself, _ = engines
    sampled = every_draft_goes(LLM(chat_checkpoint, speculative_config={
        "method": "draft_model", "model": str(chat_checkpoint), "num_speculative_tokens": 3,
        "draft_sampling": "sampled"}, **OPTIONS))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    for llm in (itself, sampled):
        llm.engine.traces = []
        with llm.engine.runner.forbid_compiles():
            got = outputs(llm, PROMPTS, params)
        assert [len(c[0][0]) for c in got] == [30] * len(PROMPTS)
    drafted, accepted = counts(sampled)
    assert drafted > 50 and accepted >= 0.95 * drafted
    greedy_drafted, greedy_accepted = counts(itself)
    assert greedy_accepted < 0.8 * greedy_drafted
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    assert outputs(sampled, PROMPTS, greedy) == outputs(plain, PROMPTS, greedy)
    with pytest.raises(ValueError, match="speculative_config.draft_sampling: 'sampled' is for methods"):
        LLM(chat_checkpoint, speculative_config={"method": "ngram", "draft_sampling": "sampled"}, **OPTIONS)
