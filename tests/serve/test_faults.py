"""Faults in the engine thread: a step that raises fails only the requests it touched (their
streams get an error event, their blocks are freed) and the server goes on; a failing metrics
observer costs nothing; a failure that loses the device state turns /health and new requests
into 503s."""
import asyncio
import json

import httpx
import pytest

from tests.serve.conftest import API_KEY, uvicorn_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 12
INJECTED = "injected step failure"


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, object]:
    """-> ("ok", completion tokens) or ("error", the error event's body)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return "error", chunk["error"]
            usage = chunk.get("usage") or usage
        return "ok", usage and usage["completion_tokens"]


def run_streams(url: str, prompts: list[str]) -> list[tuple[str, object]]:
    async def run():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(stream_one(client, url, p) for p in prompts)), 120)

    return asyncio.run(run())


class FailingStep:
    """Wraps the runner's ``dispatch``: the k-th step that runs rows raises, either as it is
    launched or as its results are read. Records the prompts of the steps launched and not yet
    read when it fires: the requests the failure must end."""

    def __init__(self, runner, tokenizer, k: int, where: str) -> None:
        self.dispatch, self.tokenizer, self.k, self.where = runner.dispatch, tokenizer, k, where
        self.count, self.unread, self.failed_prompts = 0, [], None

    def __call__(self, out):
        self.count += bool(out.seq_ids)
        fire = bool(out.seq_ids) and self.count == self.k
        if fire and self.where == "dispatch":
            self._fire([*self.unread, out])
        pending = self.dispatch(out)
        self.unread.append(out)
        result = pending.result

        def read():
            if fire and self.where == "result":
                self._fire(self.unread)
            self.unread.remove(out)
            return result()

        pending.result = read
        return pending

    def _fire(self, outs) -> None:
        self.failed_prompts = {self.tokenizer.decode(seq.request.prompt_token_ids)
                               for out in outs for seq in out.scheduled_seqs}
        raise RuntimeError(INJECTED)


@pytest.mark.parametrize("where", ["dispatch", "result"])
def test_a_failing_step_ends_only_its_requests_and_the_server_goes_on(server, monkeypatch, where):
    server.wait_idle()
    runner = server.engine.engine.runner
    failing = FailingStep(runner, server.host.tokenizer, k=2, where=where)
    monkeypatch.setattr(runner, "dispatch", failing)
    prompts = [f"request {i:03d}" for i in range(30)]
    results = dict(zip(prompts, run_streams(server.url, prompts)))

    failed = {p for p, (kind, _) in results.items() if kind == "error"}
    assert failed and failed == failing.failed_prompts
    for p in failed:
        error = results[p][1]
        assert error["code"] == 500 and INJECTED in error["message"]
    assert [results[p] for p in prompts if p not in failed] == [("ok", MAX_TOKENS)] * (30 - len(failed))
    server.wait_idle()
    kv = server.engine.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_usable_blocks
    assert run_streams(server.url, ["after the failure"] * 3) == [("ok", MAX_TOKENS)] * 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_failing_metrics_observer_neither_fails_requests_nor_stops_the_engine(server, monkeypatch):
    server.wait_idle()

    def broken(*_args):
        raise RuntimeError("metrics are broken")

    for name in ("on_step", "on_tokens", "on_finish", "on_idle"):
        monkeypatch.setattr(server.metrics, name, broken)
    prompts = [f"observed {i}" for i in range(6)]
    assert run_streams(server.url, prompts) == [("ok", MAX_TOKENS)] * 6
    assert server.engine._thread.is_alive()
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()


# ---- a server of its own, which the test breaks ----
@pytest.fixture()
def fragile_server(chat_checkpoint):
    from jaxengine.llm import LLM
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    llm = LLM(chat_checkpoint, max_num_batched_tokens=16, max_num_seqs=4, block_size=4, max_model_len=64,
              num_kv_blocks=64, progress=False, async_scheduling=True)
    metrics = EngineMetrics("tiny")
    engine = AsyncEngine(llm, observer=metrics)
    app = build_app(engine, served_model_name="tiny", metrics=metrics, api_key=API_KEY)
    with uvicorn_thread(app, log_level="critical") as url:
        yield url, engine


def test_a_step_that_loses_the_kv_cache_turns_health_and_new_requests_into_503(fragile_server, monkeypatch):
    import jax

    url, engine = fragile_server
    runner = engine.engine.runner
    dispatch, calls = runner.dispatch, []

    def lose_the_cache(out):
        calls.append(out)
        if len(calls) == 3:            # as a device call that failed after its donated caches were taken
            for cache in jax.tree.leaves(runner.kv_caches):
                cache.delete()
            raise RuntimeError(INJECTED)
        return dispatch(out)

    monkeypatch.setattr(runner, "dispatch", lose_the_cache)
    assert httpx.get(f"{url}/health").status_code == 200
    (kind, error), = run_streams(url, ["doomed"])
    assert kind == "error" and error["code"] == 503
    assert error["message"].startswith(f"internal error in the engine step: {INJECTED}; the engine cannot recover")
    assert error["message"].endswith("restart the server")
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503
    reason = health.json()["error"]["message"]
    assert reason == f"the server cannot serve requests: {error['message']}"
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    refused = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["message"] == reason
    assert engine._thread.is_alive()                 # it answers, it does not hang


def test_a_loop_that_keeps_failing_outside_the_step_turns_unhealthy_and_answers_everyone(monkeypatch):
    """Requests already held and requests queued later all get a 503; nobody hangs."""
    from jaxengine.serve import async_engine as ae

    engine = _fake_async_engine()
    monkeypatch.setattr(engine, "_step", lambda: (_ for _ in ()).throw(RuntimeError("loop bug")))

    async def run():
        first = engine.generate("a", [1, 2, 3], _params())
        engine.start()
        deltas = [d async for d in first]
        late = [d async for d in engine.generate("b", [1, 2, 3], _params())]
        return deltas, late

    deltas, late = asyncio.run(asyncio.wait_for(run(), 30))
    for stream in (deltas, late):
        assert len(stream) == 1 and stream[0].finished and stream[0].error_status == 503
        assert "the engine loop keeps failing (loop bug)" in stream[0].error
    assert engine.health_problem == stream[0].error
    with pytest.raises(ae.EngineUnhealthyError, match="restart the server"):
        engine.check([1, 2, 3], _params())
    engine.shutdown()
    assert not engine._thread.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_thread_that_ends_anyway_answers_its_requests_and_reports_it(monkeypatch):
    """Even what no handler should catch (here a KeyboardInterrupt) leaves nobody waiting."""
    engine = _fake_async_engine()

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_step", interrupted)

    async def run():
        deltas = engine.generate("a", [1, 2, 3], _params())
        engine.start()
        return [d async for d in deltas]

    (delta,) = asyncio.run(asyncio.wait_for(run(), 30))
    engine._thread.join(10)
    assert delta.finished and delta.error_status == 503
    assert delta.error == engine.health_problem == "the engine thread stopped; restart the server"


def _params():
    from jaxengine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=4, ignore_eos=True)


def _fake_async_engine():
    """An AsyncEngine over the fake runner: no model, no tokenizer."""
    from types import SimpleNamespace

    from jaxengine import Engine, EngineConfig
    from jaxengine.testing.fake_runner import HashRunner
    from jaxengine.serve.async_engine import AsyncEngine

    cfg = EngineConfig().replace(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    engine = Engine(cfg, HashRunner(64, 0, 4), eos_token_id=0)
    llm = SimpleNamespace(engine=engine, tokenizer=None, check_request=lambda ids, params: None,
                          add_request=lambda request_id, ids, params, priority=0, arrival_time=None, slo=None,
                          lora_request=None: engine.add_request(request_id, ids, params, priority=priority,
                                                                arrival_time=arrival_time, slo=slo,
                                                                lora_request=lora_request))
    return AsyncEngine(llm)


class FailingRunner:
    """The fake runner, but its k-th step with rows raises before it runs."""

    def __init__(self, runner, k: int) -> None:
        self.runner, self.k, self.count, self.steps = runner, k, 0, []

    def execute(self, out):
        if out.seq_ids:
            self.count += 1
            self.steps.append({seq.request.request_id for seq in out.scheduled_seqs})
            if self.count == self.k:
                raise RuntimeError(INJECTED)
        return self.runner.execute(out)


def run_engine(k: int | None, async_scheduling: bool):
    """16 requests on the fake runner (its tokens hash the context read back through the block
    table, so a survivor whose cache or state was disturbed would change its tokens); the
    k-th step fails and the requests it touched are aborted. -> (engine, runner, outputs, failed)."""
    from jaxengine import Engine, EngineConfig, SamplingParams
    from jaxengine.testing.fake_runner import HashRunner

    cfg = EngineConfig().replace(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24, max_num_seqs=6)
    runner = FailingRunner(HashRunner(64, 0, 4), k or 0)
    engine = Engine(cfg, runner, eos_token_id=0, async_scheduling=async_scheduling)
    requests = [engine.add_request(f"r{i}", [1 + i, 2 + i, 3 + i, 4 + i, 5 + i], SamplingParams(
        max_tokens=6, ignore_eos=True)) for i in range(16)]
    failed: list[str] = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        try:
            engine.step()
        except RuntimeError:
            failed = engine.abandon_failed_step()
            for request_id in failed:
                engine.abort(request_id)
    else:
        raise AssertionError(f"still unfinished after 500 steps: {sorted(engine.scheduler.requests)}")
    outputs = {r.request_id: r.seqs[0].output_token_ids for r in requests if r.request_id not in failed}
    return engine, runner, outputs, failed


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_after_a_failed_step_the_survivors_get_the_tokens_of_a_run_without_it(k, async_scheduling):
    _, _, clean, _ = run_engine(None, async_scheduling)
    engine, runner, outputs, failed = run_engine(k, async_scheduling)
    touched = runner.steps[k - 1] | (runner.steps[k - 2] if async_scheduling and k > 1 else set())
    assert failed and set(failed) <= touched and runner.steps[k - 1] <= set(failed)
    assert outputs == {rid: tokens for rid, tokens in clean.items() if rid not in failed}
    assert all(len(tokens) == 6 for tokens in outputs.values())
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and not engine.scheduler.requests
    engine.flush()
    assert not runner.runner.tokens and not runner.runner.tables      # the runner forgot every sequence
