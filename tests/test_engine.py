import pytest

from jaxengine import Engine, EngineConfig, SamplingParams
from jaxengine.request import RequestStatus
from jaxengine.testing.fake_runner import ConstantRunner, HashRunner


def test_engine_step_loop_with_the_hash_runner_and_traces():
    cfg = EngineConfig().replace(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8, max_num_seqs=4,
                                 enable_prefix_caching=False, watermark=0.0)
    engine = Engine(cfg, HashRunner(10, 0, 4), eos_token_id=None, trace=True)
    for i in range(3):
        engine.add_request(f"r{i}", [10 + i] * 4, SamplingParams(max_tokens=6, ignore_eos=True))
    finished = engine.run()
    assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2"]
    assert all(r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 6 for r in finished)
    first = engine.traces[0]
    assert (first.step, first.num_prefill_tokens, first.num_decode_tokens, first.num_running) == (0, 8, 0, 2)
    assert (first.num_waiting, first.kv_usage) == (1, 2 / 9)
    assert sum(t.num_decode_tokens + t.num_prefill_tokens for t in engine.traces) == 3 * (4 + 5)
    assert sum(t.num_preemptions for t in engine.traces) == 0
    assert engine.traces[-1].kv_usage == 0.0 and engine.num_steps == len(engine.traces)


def test_engine_abort_and_eos():
    engine = Engine(EngineConfig().replace(num_gpu_blocks=32), ConstantRunner(token=7), eos_token_id=7)
    engine.add_request("stops", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("ignores", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("aborted", [1, 2, 3], SamplingParams(max_tokens=5))
    assert engine.abort("aborted")
    by_id = {r.request_id: r for r in engine.run()}
    assert by_id["stops"].output_token_ids == [7] and by_id["stops"].status.finish_reason == "stop"
    assert by_id["ignores"].output_token_ids == [7] * 5
    assert by_id["aborted"].status is RequestStatus.FINISHED_ABORTED
    assert engine.scheduler.kv.num_free_blocks == 31


def outgrowing_engine(num_gpu_blocks: int, **options) -> Engine:
    cfg = EngineConfig().replace(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=8,
                                 max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False,
                                 watermark=0.0)
    engine = Engine(cfg, HashRunner(num_gpu_blocks, 8, 4), eos_token_id=None, **options)
    engine.add_request("g", [3, 1, 4, 1, 5, 9], SamplingParams(max_tokens=30, n=2, ignore_eos=True))
    return engine


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_outgrows_the_whole_pool_ends_by_length_with_what_it_generated(async_scheduling):
    """6 prompt tokens, two samples, 6 usable blocks: the shared first block and two blocks of
    each sample's own hold positions 0-11; the 7th token sampled, the next step has no room for
    both samples (one spare block)."""
    full = outgrowing_engine(64).run()[0]
    engine = outgrowing_engine(7, async_scheduling=async_scheduling)
    (g,) = engine.run()
    assert g.status is RequestStatus.FINISHED_LENGTH and g.status.finish_reason == "length"
    assert [s.output_token_ids for s in g.seqs] == [s.output_token_ids[:7] for s in full.seqs]
    assert all(s.status is RequestStatus.FINISHED_LENGTH for s in g.seqs)
    assert engine.scheduler.kv.num_free_blocks == 6


def test_swap_fallbacks_are_counted_per_step_in_the_trace_and_by_the_server_metric():
    from jaxengine.serve.metrics import EngineMetrics

    cfg = EngineConfig().replace(block_size=4, num_gpu_blocks=7, num_cpu_blocks=2, max_num_batched_tokens=64,
                                 max_num_seqs=8, enable_prefix_caching=False, watermark=0.0)
    engine = Engine(cfg, HashRunner(7, 2, 4), eos_token_id=None, trace=True)
    engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("g", [5, 6, 7, 8], SamplingParams(max_tokens=8, n=2, ignore_eos=True))
    metrics = EngineMetrics("m")
    while engine.has_unfinished_requests():
        engine.step()
        metrics.on_step(engine)
    assert [t.num_swap_fallbacks for t in engine.traces] == [0] * 5 + [1] + [0] * (len(engine.traces) - 6)
    assert engine.traces[5].num_preemptions == 1 and engine.traces[5].num_blocks_swapped_out == 0
    value = metrics.registry.get_sample_value("jaxengine:num_swap_fallbacks_total", {"model_name": "m"})
    assert value == 1.0


@pytest.fixture(scope="module")
def llm_32(chat_checkpoint):
    from jaxengine import LLM

    return LLM(chat_checkpoint, max_model_len=32, max_num_batched_tokens=16, max_num_seqs=2, block_size=4,
               num_kv_blocks=24, progress=False)


def test_max_tokens_up_to_the_context_limit_is_honoured_exactly_and_one_more_is_refused(llm_32):
    prompt = [ord(c) for c in "twenty tokens of txt"]
    assert len(prompt) == 20
    out = llm_32.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"^max_tokens: prompt \(20 tokens\) \+ max_tokens \(13\) = 33 exceeds "
                                         r"the maximum context length of 32 tokens"):
        llm_32.generate([prompt], SamplingParams(max_tokens=13), use_tqdm=False)
    fill = llm_32.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(fill.outputs[0].token_ids) == 12                     # None: up to the context limit
    with pytest.raises(ValueError, match=r"^prompt: 32 tokens leave no room for output within the maximum "
                                         r"context length of 32 tokens"):
        llm_32.generate([prompt + prompt[:12]], SamplingParams(max_tokens=None), use_tqdm=False)
    assert not llm_32.engine.scheduler.has_unfinished_requests()
