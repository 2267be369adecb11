"""Overload on loopback: a server in a process of its own under closed-loop clients at
concurrency 1 to 256 answers every request in full (no 5xx), holds no KV block afterwards and
does not grow in memory; with a bound on the waiting queue the excess gets 503s and the rest
is served."""
import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import psutil

from tests.serve.conftest import API_KEY, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 4
LEVELS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
REQUESTS = {c: max(32, 2 * c) for c in LEVELS}      # 1,120 in all: the wide levels carry most
WARM_UP = 100
RSS_GROWTH_LIMIT = 100 * 2**20


async def one_request(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, int | None]:
    """-> (status, completion tokens); streamed and whole responses alternate."""
    body = {"model": "tiny", "prompt": [1 + (i + k) % 200 for k in range(8)], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": bool(i % 2),
            "stream_options": {"include_usage": True} if i % 2 else None}
    if not i % 2:
        r = await client.post(f"{url}/v1/completions", json=body)
        return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
    tokens = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if '"error"' in line:
                return 500, None
            if '"usage"' in line:
                tokens = int(re.search(r'"completion_tokens":(\d+)', line).group(1))
        return r.status_code, tokens


async def closed_loop(url: str, concurrency: int, count: int, first: int) -> list[tuple[int, int | None]]:
    """``concurrency`` clients, each sending its next request when the last one is answered."""
    todo, results = iter(range(first, first + count)), []

    async def client_loop(client):
        for i in todo:
            results.append(await one_request(client, url, i))

    # A connection idle for as long as the server keeps it (5 s) may be closed as it is reused.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=1.0)
    async with httpx.AsyncClient(headers=AUTH, timeout=60, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(concurrency))), timeout=120)
    return results


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r'^jaxengine:(\w+)\{model_name="tiny"\} (\S+)$', text, re.M)}


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["num_requests_running"] == m["num_requests_waiting"] == m["kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def wait_compiled(url: str, timeout: float = 120.0) -> None:
    """Until every step bucket is compiled (the server compiles the larger ones while it serves)."""
    deadline = time.monotonic() + timeout
    while not httpx.get(f"{url}/health").json()["all_buckets_compiled"]:
        assert time.monotonic() < deadline, "the step buckets were not all compiled in time"
        time.sleep(0.2)


def start_server(checkpoint) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxengine.serve", "--model", str(checkpoint), "--port", str(port),
           "--api-key", API_KEY, "--served-model-name", "tiny", "--max-model-len", "128", "--num-kv-blocks", "400",
           "--block-size", "4", "--max-num-seqs", "32", "--max-num-batched-tokens", "64", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 180
    while not any("serving tiny at" in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}", lines


def test_concurrency_1_to_256_answers_every_request_in_full_without_growing(chat_checkpoint):
    proc, url, lines = start_server(chat_checkpoint)
    try:
        warm = asyncio.run(closed_loop(url, 32, WARM_UP, 0))
        assert warm == [(200, MAX_TOKENS)] * WARM_UP
        wait_compiled(url)              # the executables are the server's, not growth under load
        wait_idle(url)
        rss_before = psutil.Process(proc.pid).memory_info().rss
        first = WARM_UP
        for c in LEVELS:
            try:
                results = asyncio.run(closed_loop(url, c, REQUESTS[c], first))
            except Exception as error:
                raise AssertionError(f"concurrency {c}: {error!r}; server output:\n{''.join(lines)}") from error
            assert results == [(200, MAX_TOKENS)] * REQUESTS[c], (c, [r for r in results if r[0] != 200][:5])
            first += REQUESTS[c]
        m = wait_idle(url)
        growth = psutil.Process(proc.pid).memory_info().rss - rss_before
        assert growth < RSS_GROWTH_LIMIT, f"resident memory grew {growth / 2**20:.0f} MiB"
        total = WARM_UP + sum(REQUESTS.values())
        assert m["generation_tokens_total"] == total * MAX_TOKENS
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.kill()
        proc.wait(30)
    assert not any("Traceback" in line for line in lines), "".join(lines)


def test_a_bounded_waiting_queue_turns_the_excess_into_503s_and_serves_the_rest(server, monkeypatch):
    """The engine thread is held while 48 requests arrive: exactly the bound's worth are taken,
    the rest get 503 with Retry-After; once released, the taken ones are served in full."""
    server.wait_idle()
    engine, bound, release = server.engine, 4, threading.Event()
    drain = engine._drain_commands
    monkeypatch.setattr(engine, "max_waiting_requests", bound)
    monkeypatch.setattr(engine, "_drain_commands", lambda block: release.wait(60) and drain(block))
    time.sleep(0.6)                 # the engine thread's current wait for commands ends

    async def burst():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
            tasks = [asyncio.create_task(client.post(f"{server.url}/v1/completions", json={
                "model": "tiny", "prompt": f"burst {i:02d}", "max_tokens": MAX_TOKENS, "ignore_eos": True}))
                for i in range(48)]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < 48 - bound and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            release.set()
            return await asyncio.gather(*tasks)

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) == 48 - bound and len(served) == bound
    assert all(r.headers["retry-after"] == "1" and "retry later" in r.json()["error"]["message"] for r in refused)
    assert [r.json()["usage"]["completion_tokens"] for r in served] == [MAX_TOKENS] * bound
    server.wait_idle()


def test_output_processing_skips_requests_still_queued(monkeypatch):
    """Per-step host work must not grow with the queue: of 256 requests, the step admits 4
    (32 tokens of budget, 8-token prompts), and only those 4 are looked at."""
    from jaxengine.output_processor import OutputProcessor
    from jaxengine.serve.async_engine import AsyncEngine, _Tracked
    from tests.serve.test_faults import _fake_async_engine, _params

    engine, looked_at = _fake_async_engine(), []
    delta = AsyncEngine._delta
    monkeypatch.setattr(AsyncEngine, "_delta", lambda self, tracked, now: (
        looked_at.append(tracked.request.request_id), delta(self, tracked, now))[1])
    for i in range(256):
        request = engine.engine.add_request(f"r{i}", [1 + i % 50] * 8, _params())
        output = OutputProcessor(request, engine.tokenizer, engine.engine.scheduler.finish_sequence)
        engine._tracked[request.request_id] = _Tracked(request, lambda d: None, output)
    engine.engine.step()
    engine._emit_all()
    assert looked_at == ["r0", "r1", "r2", "r3"]
    assert len(engine.engine.scheduler.waiting) == 252


def test_a_request_arrives_when_the_client_sent_it_not_when_the_engine_thread_takes_it():
    """A request that comes in during a long step waits behind it: that wait is queueing, which
    the delay factor, fcfs and the queue-time metric must count."""
    import asyncio

    from tests.serve.test_faults import _fake_async_engine, _params

    engine, now = _fake_async_engine(), [100.0]
    engine.engine.clock = lambda: now[0]

    async def send():
        return engine.generate("late", [1, 2, 3], _params())

    asyncio.run(send())
    now[0] = 102.5                          # the engine thread's step ends 2.5 s later
    assert engine._drain_commands(block=False)
    request = engine._tracked["late"].request
    assert request.arrival_time == 100.0 and request.times.queued == 100.0
