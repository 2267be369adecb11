"""Data parallelism: the router's choices, replicas on the fake runner (the outputs of one
engine, only the failing replica's requests failed), and 2 replicas of 2 devices each on the
simulated CPU devices, offline and through the server, with the single-device engine's tokens."""
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxengine import Engine, EngineConfig, SamplingParams
from jaxengine.parallel.data_parallel import DataParallelEngine, choose_replica, closeness_bound
from jaxengine.request import RequestStatus
from jaxengine.testing.fake_runner import HashRunner


# ---- the router ----
def test_closeness_bound_is_two_requests_or_a_quarter_of_the_least_load():
    assert [closeness_bound(n) for n in (0, 1, 8, 11, 12, 20, 100)] == [2, 2, 2, 2, 3, 5, 25]


@pytest.mark.parametrize("loads, cached, expected", [
    ([3, 1, 2], [0, 0, 0], 1),           # least loaded
    ([2, 2, 2], [0, 0, 0], 0),           # a tie: the lower index
    ([0, 2], [0, 3], 1),                 # the prefix is cached within 2 requests of the least load
    ([0, 3], [0, 3], 0),                 # ... but not 3 requests off
    ([20, 25], [0, 1], 1),               # a quarter of 20 is 5: close
    ([20, 26], [0, 1], 0),               # 6 is not
    ([4, 5, 6, 3], [1, 3, 2, 0], 1),     # the longest cached prefix among the close ones
    ([4, 5, 6, 3], [2, 2, 2, 0], 0),     # equal prefixes: the lower load
    ([9, 0, 4], [5, 0, 0], 1),           # the cache of a replica far off is ignored
])
def test_the_router_picks_the_least_loaded_or_the_closest_cached_prefix(loads, cached, expected):
    assert choose_replica(loads, lambda i: cached[i]) == expected


def test_the_router_reads_no_cache_when_one_replica_is_clearly_least_loaded():
    def never(_i):
        raise AssertionError("looked up a prefix")

    assert choose_replica([5, 0, 9], never) == 1


# ---- replicas on the fake runner ----
CFG = EngineConfig().replace(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24, max_num_seqs=6)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def fake_engine(runner=None) -> Engine:
    return Engine(CFG, runner or HashRunner(64, 0, 4), eos_token_id=0)


def prompts(n: int) -> list[list[int]]:
    return [[1 + i, 2 + i, 3 + i, 4 + i, 5 + i, 6 + i] for i in range(n)]


def run(engine, ids: list[list[int]]) -> dict[str, list[int]]:
    requests = [engine.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(ids)]
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    return {r.request_id: r.output_token_ids for r in requests}


def test_replicas_share_the_work_and_give_the_tokens_of_one_engine():
    dp = DataParallelEngine([fake_engine(), fake_engine()], trace=True)
    assert run(dp, prompts(12)) == run(fake_engine(), prompts(12))
    assert dp.num_routed == [6, 6]
    assert all(r.stats().kv_usage == 0 and r.num_steps > 0 for r in dp.replicas)
    assert dp.traces[0].num_prefill_tokens == 24 + 24       # both replicas' first steps, summed


def test_a_cached_prefix_draws_its_prompt_while_loads_are_close():
    dp = DataParallelEngine([fake_engine(), fake_engine()])
    shared = list(range(10, 22))                            # 3 blocks
    run(dp, [[50] * 5, shared + [1]])                       # the shared prefix is cached on replica 1
    assert [r.cached_prefix_blocks(shared + [2]) for r in dp.replicas] == [0, 3]
    kv = dp.replicas[1].scheduler.kv

    def state():
        return (kv.pool.free_queue.ids(), list(kv.pool.ref_cnt), dict(kv.pool.cached_block),
                kv.prefix_cache_queries, kv.prefix_cache_hits)

    before = state()
    for i in range(2):
        dp.replicas[1].add_request(f"busy-{i}", [60 + i] * 5, PARAMS)
    assert [dp.route(shared + [2]), dp.route([5] * 13)] == [1, 0]     # loads 0 and 2: close
    dp.replicas[1].add_request("busy-2", [62] * 5, PARAMS)
    assert dp.route(shared + [2]) == 0                                 # 0 and 3: not close
    assert state() == before                                           # the look-ups changed nothing
    dp.abort("busy-2")
    hit = dp.add_request("hit", shared + [2], PARAMS)
    assert dp.replicas[1].has_request("hit")
    while dp.has_unfinished_requests():
        dp.step()
    assert hit.num_cached_tokens == 12


def test_ids_aborts_and_stop_strings_reach_the_requests_replica():
    dp = DataParallelEngine([fake_engine(), fake_engine()])
    a, b = (dp.add_request(rid, p, PARAMS) for rid, p in zip(("a", "b"), prompts(2)))
    assert dp.replicas[1].has_request("b")
    with pytest.raises(ValueError, match="request_id: 'b' is already in use"):
        dp.add_request("b", [1, 2], PARAMS)
    dp.step()
    assert [r.request_id for r in dp.running_requests()] == ["a", "b"]
    dp.finish_sequence(b.seqs[0], RequestStatus.FINISHED_STOPPED, "stop")
    assert b.status is RequestStatus.FINISHED_STOPPED and not dp.has_request("b")
    assert dp.abort("a") and not dp.abort("a") and a.status is RequestStatus.FINISHED_ABORTED
    assert not dp.has_unfinished_requests() and dp.num_waiting == 0


class FailingRunner(HashRunner):
    """Raises at its ``k``-th step that runs rows."""

    def __init__(self, k: int) -> None:
        super().__init__(64, 0, 4)
        self.k, self.count = k, 0

    def execute(self, out):
        self.count += bool(out.seq_ids)
        if out.seq_ids and self.count == self.k:
            raise RuntimeError("injected")
        return super().execute(out)


def test_a_failing_replica_fails_only_its_own_requests():
    dp = DataParallelEngine([fake_engine(), fake_engine(FailingRunner(2))])
    requests = [dp.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(prompts(8))]
    on_failing = {r.request_id for r in requests if dp.replicas[1].has_request(r.request_id)}
    failed: list[str] = []
    while dp.has_unfinished_requests():
        try:
            dp.step()
        except RuntimeError:
            failed = dp.abandon_failed_step()
            for request_id in failed:
                dp.abort(request_id)
    clean = run(fake_engine(), prompts(8))
    assert failed and set(failed) <= on_failing and len(on_failing) == 4
    survivors = {r.request_id: r.output_token_ids for r in requests if r.request_id not in failed}
    assert survivors == {rid: tokens for rid, tokens in clean.items() if rid not in failed}
    assert all(len(tokens) == 6 for tokens in survivors.values()) and len(survivors) >= 4


# ---- two replicas of two devices on the simulated CPU devices ----
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, max_model_len=64, num_kv_blocks=64,
              token_buckets=[8, 16], request_buckets=[8], progress=False)
TEXTS = ["The quick brown fox", "Once upon a time", "0123", "Hello there, how are you today?", "a b c",
         "Data parallel replicas"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def single(chat_checkpoint):
    from jaxengine import LLM

    llm = LLM(chat_checkpoint, **ENGINE)
    llm.wait_until_compiled()           # the tests compare schedules: all buckets from the start
    return llm


@pytest.fixture(scope="module")
def dp_llm(chat_checkpoint):
    from jaxengine import LLM

    llm = LLM(chat_checkpoint, **ENGINE, tensor_parallel_size=2, data_parallel_size=2, async_scheduling=True)
    llm.wait_until_compiled()
    return llm


def test_replicas_run_on_their_own_devices(dp_llm):
    import jax

    devices = [{d.id for d in r.runner.kv_caches[0].sharding.device_set} for r in dp_llm.engine.replicas]
    assert devices == [{d.id for d in jax.devices()[:2]}, {d.id for d in jax.devices()[2:4]}]


def test_each_replica_compiled_its_buckets_in_the_background(dp_llm):
    runners = dp_llm.runners
    assert [sorted(r._executables) for r in runners] == [[(8, 8), (16, 8)]] * 2
    assert all(r.step_limits() == (16, 8) and not r.is_compiling for r in runners)
    assert dp_llm.compile_progress() == (4, 4)


def test_offline_generate_equals_one_device_without_compiling_or_leaking(single, dp_llm):
    expected = [o.outputs[0].token_ids for o in single.generate(TEXTS, GREEDY, use_tqdm=False)]
    routed = list(dp_llm.engine.num_routed)
    with contextlib.ExitStack() as stack:
        for replica in dp_llm.engine.replicas:
            stack.enter_context(replica.runner.forbid_compiles())
        outs = dp_llm.generate(TEXTS, GREEDY, use_tqdm=False)
        again = dp_llm.generate(["Once upon a time there"], GREEDY, use_tqdm=False)[0]
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Alternately while all are queued; then to replica 1, which cached "Once upon a time".
    assert [a - b for a, b in zip(dp_llm.engine.num_routed, routed)] == [3, 4]
    assert again.num_cached_tokens >= 16
    for replica in dp_llm.engine.replicas:
        kv = replica.scheduler.kv
        assert kv.num_free_blocks == kv.num_usable_blocks and not replica.has_unfinished_requests()


def test_the_server_spreads_concurrent_requests_over_the_replicas(single, dp_llm):
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics
    from tests.serve.conftest import uvicorn_thread

    import openai

    texts = [f"{i} concurrent request" for i in range(8)]
    expected = {tuple(o.prompt_token_ids): o.outputs[0] for o in single.generate(texts, GREEDY, use_tqdm=False)}
    metrics, tokens = EngineMetrics("tiny"), {}
    on_finish = metrics.on_finish
    metrics.on_finish = lambda r: (tokens.__setitem__(tuple(r.prompt_token_ids), r.output_token_ids), on_finish(r))
    routed = list(dp_llm.engine.num_routed)
    app = build_app(AsyncEngine(dp_llm, observer=metrics), served_model_name="tiny", metrics=metrics)
    with uvicorn_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        start = threading.Barrier(len(texts))

        def complete(text: str):
            start.wait()
            return client.completions.create(model="tiny", prompt=text, max_tokens=10, temperature=0)

        with ThreadPoolExecutor(len(texts)) as pool:
            replies = list(pool.map(complete, texts))
        dashboard = httpx.get(f"{url}/dashboard/state").json()
    assert [r.choices[0].text for r in replies] == [expected[tuple(single.encode(t))].text for t in texts]
    assert tokens == {key: out.token_ids for key, out in expected.items()}
    per_replica = [a - b for a, b in zip(dp_llm.engine.num_routed, routed)]
    assert sum(per_replica) == len(texts) and min(per_replica) > 0, per_replica
    sample = metrics.registry.get_sample_value
    assert [sample("jaxengine:replica_requests_routed_total", {"model_name": "tiny", "replica": str(i)})
            for i in range(2)] == dp_llm.engine.num_routed        # since the engine started
    assert sample("jaxengine:replica_kv_cache_usage_perc", {"model_name": "tiny", "replica": "1"}) == 0
    assert sample("jaxengine:num_requests_running", {"model_name": "tiny"}) == 0
    assert dashboard["replicas"] == [{"num_waiting": 0, "num_running": 0, "num_swapped": 0, "kv_usage": 0.0,
                                      "routed": routed} for routed in dp_llm.engine.num_routed]
    assert dashboard["settings"]["resolved"]["replicas"] == 2


def test_more_replicas_than_devices_are_refused_naming_the_option(chat_checkpoint):
    from jaxengine import LLM

    with pytest.raises(ValueError, match=r"^data_parallel_size: 3 replicas of 4 device\(s\) need 12 devices, "
                                         r"8 available"):
        LLM(chat_checkpoint, **ENGINE, tensor_parallel_size=4, data_parallel_size=3)
    with pytest.raises(ValueError, match=r"^data_parallel_size: must be an integer >= 1, got 0"):
        LLM(chat_checkpoint, **ENGINE, data_parallel_size=0)
