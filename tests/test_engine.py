from jaxengine import Engine, EngineConfig, SamplingParams
from jaxengine.request import RequestStatus
from jaxengine.runner.fake_runner import ConstantRunner, HashRunner


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
