"""Load on loopback: 200 concurrent streams, a fifth of the clients leaving mid-stream; and a
SIGTERM while streams run."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.serve.conftest import API_KEY, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 12


async def stream_one(client: httpx.AsyncClient, url: str, i: int, leave: bool) -> tuple[int, int | None]:
    """-> (HTTP status, completion tokens from the usage chunk; None if the client left)."""
    body = {"model": "tiny", "prompt": f"request {i:03d}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 1.0, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if leave:
                return r.status_code, None          # leaving the block closes the connection
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
        return r.status_code, usage and usage["completion_tokens"]


def test_200_concurrent_streams_with_a_fifth_of_clients_leaving(server):
    before = {k: server.metric("request_success_total", finished_reason=k) for k in ("length", "abort")}
    prompt_before, generated_before = server.metric("prompt_tokens_total"), server.metric("generation_tokens_total")

    async def run():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(stream_one(client, server.url, i, leave=i % 5 == 0) for i in range(200))), timeout=240)

    results = asyncio.run(run())
    assert all(status == 200 for status, _ in results)                      # no 5xx, no 503
    stayed = [tokens for i, (_, tokens) in enumerate(results) if i % 5]
    assert stayed == [MAX_TOKENS] * 160                                      # exactly max_tokens each
    server.wait_idle()
    length = server.metric("request_success_total", finished_reason="length") - before["length"]
    aborted = server.metric("request_success_total", finished_reason="abort") - before["abort"]
    assert length + aborted == 200 and length >= 160                       # a leaver may have finished first
    assert server.metric("prompt_tokens_total") - prompt_before == length * len("request 000")
    assert server.metric("generation_tokens_total") - generated_before >= 160 * MAX_TOKENS
    assert server.metric("kv_cache_usage_perc") == 0
    # 400 blocks of 4; a token costs 2 layers x (K + V) x 2 heads x 16 x 4 bytes = 512 bytes
    assert (server.metric("kv_cache_tokens"), server.metric("kv_cache_tokens_per_gib")) == (1600, (1 << 30) // 512)
    assert server.metric("num_requests_running") == server.metric("num_requests_waiting") == 0
    assert server.engine.engine.scheduler.kv.pool.num_free_blocks == server.engine.engine.scheduler.kv.num_usable_blocks


def test_sigterm_during_load_exits_cleanly_within_the_grace_period(chat_checkpoint):
    port, grace = free_port(), 3
    cmd = [sys.executable, "-m", "jaxengine.serve", "--model", str(chat_checkpoint), "--port", str(port),
           "--api-key", API_KEY, "--served-model-name", "tiny", "--max-model-len", "128", "--num-kv-blocks", "400",
           "--block-size", "4", "--max-num-seqs", "32", "--max-num-batched-tokens", "64",
           "--shutdown-grace", str(grace), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while not any("serving tiny at" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"

        async def load():
            async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
                body = {"model": "tiny", "prompt": "go", "max_tokens": 100, "ignore_eos": True, "stream": True}
                tasks = [asyncio.create_task(_drain(client, url, body)) for _ in range(30)]
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks, return_exceptions=True)

        start = time.monotonic()
        results = asyncio.run(load())
        proc.wait(timeout=grace + 30)
        assert proc.returncode == 0, "".join(lines)
        assert time.monotonic() - start < grace + 30
        assert any(r == "done" for r in results), results     # in-flight streams finished in the grace period
    finally:
        if proc.poll() is None:
            proc.kill()


async def _drain(client: httpx.AsyncClient, url: str, body: dict) -> str:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
        return "cut"
    except httpx.HTTPError as error:
        return type(error).__name__
