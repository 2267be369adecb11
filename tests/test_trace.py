"""Step traces: the records agree with the run, the JSONL file reads back equal to the engine's
records, the writer's batching, and the option through LLM and data parallelism."""
import gc
import json

import pytest

from jaxengine import Engine, EngineConfig, SamplingParams
from jaxengine.parallel.data_parallel import DataParallelEngine
from jaxengine.testing.fake_runner import HashRunner
from jaxengine.trace import StepTrace, TraceWriter, read_trace, replica_trace_file
from tests.conftest import make_checkpoint

CFG = EngineConfig().replace(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                             watermark=0.0)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def record(step: int, **fields) -> StepTrace:
    zeros = {name: 0 for name in StepTrace.__dataclass_fields__ if name not in ("expert_tokens", "accepted_per_position")}
    return StepTrace(**{**zeros, "step": step, **fields})


def run_with_prefix_hits(engine) -> list:
    """A runs alone; then B (A's prompt + 2 tokens) finds A's 2 full blocks cached and C (A's
    prompt again) its first block (the block of a prompt's last token is always computed)."""
    a = engine.add_request("a", PROMPT, PARAMS)
    engine.run()
    b = engine.add_request("b", PROMPT + [9, 10], PARAMS)
    c = engine.add_request("c", PROMPT, PARAMS)
    engine.run()
    engine.flush()
    return [a, b, c]


def test_records_agree_with_the_run_and_the_file_reads_back_equal(tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = Engine(CFG, HashRunner(64, 0, 4), eos_token_id=None, trace=True, trace_file=path)
    requests = run_with_prefix_hits(engine)
    traces = engine.traces
    assert read_trace(path) == traces
    assert [(t.num_rows, t.num_prefill_tokens, t.num_decode_tokens, t.num_prefix_hit_tokens) for t in traces] == [
        (1, 8, 0, 0), (1, 0, 1, 0), (1, 0, 1, 0),          # a
        (2, 2 + 4, 0, 8 + 4), (2, 0, 2, 0), (2, 0, 2, 0),  # b and c, after their prefix hits
        (0, 0, 0, 0)]                                      # flush's empty step
    assert [r.num_cached_tokens for r in requests] == [0, 8, 4]
    assert sum(t.num_prefix_hit_tokens for t in traces) == sum(r.num_cached_tokens for r in requests)
    computed = sum(r.num_prompt_tokens - r.num_cached_tokens + len(r.output_token_ids) - 1 for r in requests)
    assert sum(t.num_prefill_tokens + t.num_decode_tokens for t in traces) == computed == 20
    assert [t.step for t in traces] == list(range(7))
    assert all(t.time + t.step_s <= u.time + 1e-6 for t, u in zip(traces, traces[1:]))   # cycles in order
    # The fake runner measures no device: all of a step is host time, with no device idle.
    assert all(t.step_s > 0 and t.host_s == t.step_s and t.device_idle_s == 0 for t in traces)


def test_each_line_is_the_records_fields(tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = Engine(CFG, HashRunner(64, 0, 4), eos_token_id=None, trace=True, trace_file=path)
    engine.add_request("a", PROMPT, PARAMS)
    engine.run()
    engine.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{**vars(t), "expert_tokens": list(t.expert_tokens),
                                                         "accepted_per_position": list(t.accepted_per_position)}
                                                    for t in engine.traces]
    assert list(json.loads(lines[0])) == list(StepTrace.__dataclass_fields__)


def test_records_are_written_in_batches_of_whole_lines(tmp_path):
    path, now = tmp_path / "steps.jsonl", [0.0]
    writer = TraceWriter(path, flush_every=3, flush_interval_s=1.0, clock=lambda: now[0])
    for step in range(2):
        writer.write(record(step))
    assert path.read_text() == ""                           # held: 2 records, no time passed
    writer.write(record(2))
    assert [t.step for t in read_trace(path)] == [0, 1, 2]  # the third record writes the batch
    writer.write(record(3))
    now[0] = 1.0
    writer.write(record(4))                                 # a second since the last write
    assert [t.step for t in read_trace(path)] == [0, 1, 2, 3, 4]
    writer.write(record(5, kv_usage=0.25, step_s=0.001234))
    writer.close()
    assert read_trace(path)[-1] == record(5, kv_usage=0.25, step_s=0.001234)


def test_held_records_are_written_when_the_writer_is_collected(tmp_path):
    path = tmp_path / "steps.jsonl"
    writer = TraceWriter(path)
    writer.write(record(0))
    del writer
    gc.collect()
    assert read_trace(path) == [record(0)]


def test_a_line_still_being_written_is_left_out(tmp_path):
    path = tmp_path / "steps.jsonl"
    with TraceWriter(path) as writer:
        writer.write(record(0))
    with open(path, "a") as f:
        f.write('{"step":1,"ti')
    assert read_trace(path) == [record(0)]


def test_a_file_that_exists_is_appended_to(tmp_path):
    path = tmp_path / "steps.jsonl"
    for step in range(2):
        with TraceWriter(path) as writer:
            writer.write(record(step))
    assert read_trace(path) == [record(0), record(1)]


def test_data_parallel_replicas_write_one_file_each(tmp_path):
    path = tmp_path / "steps.jsonl"
    replicas = [Engine(CFG, HashRunner(64, 0, 4), eos_token_id=None, trace=True,
                       trace_file=replica_trace_file(path, r)) for r in range(2)]
    dp = DataParallelEngine(replicas, trace=True)
    for i in range(4):
        dp.add_request(f"r{i}", [10 * i + j for j in range(1, 7)], PARAMS)
    while dp.has_unfinished_requests():
        dp.step()
    dp.flush()
    assert replica_trace_file(path, 1) == tmp_path / "steps.replica1.jsonl"
    for r, replica in enumerate(replicas):
        assert read_trace(replica_trace_file(path, r)) == replica.traces
        assert sum(t.num_prefill_tokens for t in replica.traces) == 2 * 6
    assert sum(t.num_prefill_tokens + t.num_decode_tokens for t in dp.traces) == 4 * (6 + 2)
    assert sum(t.num_rows for t in dp.traces) == sum(t.num_rows for r in replicas for t in r.traces)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from jaxengine import LLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    make_checkpoint(folder, "llama")
    return LLM(str(folder), skip_tokenizer_init=True, token_buckets=[8, 16], request_buckets=[8], max_num_seqs=8,
               max_num_batched_tokens=16, block_size=4, max_model_len=64, progress=False, compile_mode="eager",
               num_kv_blocks=64, trace_file=str(folder / "steps.jsonl")), folder / "steps.jsonl"


def test_the_option_through_llm_writes_the_model_runners_records(tiny_llm):
    llm, path = tiny_llm
    llm.engine.traces = []
    prompt = list(range(1, 13))                             # 3 full blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = llm.generate([prompt], params, use_tqdm=False) + \
        llm.generate([prompt + [20, 21], list(range(30, 50))], params, use_tqdm=False)
    traces = llm.engine.traces
    assert read_trace(path) == traces
    assert [o.num_cached_tokens for o in outputs] == [0, 12, 0]
    assert sum(t.num_prefix_hit_tokens for t in traces) == 12
    assert sum(t.num_prefill_tokens for t in traces) == 12 + 2 + 20
    assert sum(t.num_decode_tokens for t in traces) == 3 * 3
    assert [t.step for t in traces] == list(range(len(traces)))
    assert all(0 <= t.host_s <= t.step_s and t.device_idle_s >= 0 for t in traces)
    assert sum(t.device_idle_s for t in traces) > 0         # each step on the CPU launches on an idle device


def test_an_experts_load_reads_back_as_it_was_written(tmp_path):
    writer = TraceWriter(tmp_path / "steps.jsonl")
    writer.write(record(0, expert_tokens=(3, 0, 5)))
    writer.write(record(1))
    writer.close()
    assert read_trace(tmp_path / "steps.jsonl") == [record(0, expert_tokens=(3, 0, 5)), record(1)]
