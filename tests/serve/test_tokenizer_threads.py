"""Prompts are tokenized off the event loop, on threads with their own tokenizer: while long
prompts are tokenized the server answers /health at once and its streams keep receiving
chunks, and every request is answered correctly."""
import asyncio
import json
import statistics
import threading
import time

import httpx

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SLOW_S = 0.8                   # how long one long prompt takes to tokenize here
NUM_STREAMS = NUM_LONG = 16
LONG_MAX_TOKENS = 8
STREAM = {"model": "tiny", "prompt": "Stream", "max_tokens": 80, "temperature": 0, "ignore_eos": True}


def long_prompt(i: int) -> str:
    text = f"{i:02d} " + "the quick brown fox jumps over the lazy dog " * 4
    return text[:MAX_MODEL_LEN - LONG_MAX_TOKENS - 8]


class SlowTokenizing:
    """Makes the tokenizer's encode and chat template slow for long texts, and records where they ran."""

    def __init__(self, monkeypatch, engine_tokenizer) -> None:
        self.calls: list[tuple[str, bool]] = []          # (thread name, was it the engine thread's tokenizer)
        self.in_progress = 0
        cls = type(engine_tokenizer)
        for name in ("encode", "apply_chat_template"):
            monkeypatch.setattr(cls, name, self._slow(getattr(cls, name), engine_tokenizer))

    def _slow(self, original, engine_tokenizer):
        def slow(tokenizer, text, *args, **kw):
            if len(str(text)) >= len(long_prompt(0)):         # a conversation counts as its repr
                self.calls.append((threading.current_thread().name, tokenizer is engine_tokenizer))
                self.in_progress += 1
                time.sleep(SLOW_S)
                self.in_progress -= 1
            return original(tokenizer, text, *args, **kw)
        return slow


async def stream_one(client, url: str, chunks: list[tuple[float, int]], i: int) -> str:
    text = ""
    async with client.stream("POST", f"{url}/v1/completions", json={**STREAM, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
                chunks.append((time.monotonic(), i))
    return text


async def probe_health(client, url: str, slow: SlowTokenizing, until: asyncio.Future) -> list[float]:
    """Latencies of /health probes sent while a long prompt was being tokenized."""
    latencies = []
    while not until.done():
        busy, start = slow.in_progress > 0, time.monotonic()
        assert (await client.get(f"{url}/health")).status_code == 200
        if busy:
            latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.02)
    return latencies


async def scenario(url: str, slow: SlowTokenizing):
    """16 streams; once all have started, 16 long prompts and a long conversation. -> (stream
    texts, the other responses, /health latencies while tokenizing, gaps between stream chunks
    while those requests ran)."""
    async with httpx.AsyncClient(headers=AUTH, timeout=300) as client:
        chunks: list[tuple[float, int]] = []
        streams = [asyncio.ensure_future(stream_one(client, url, chunks, i)) for i in range(NUM_STREAMS)]
        while len({i for _, i in chunks}) < NUM_STREAMS:           # every stream has started
            await asyncio.sleep(0.01)
        long = [client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": long_prompt(i),
                                                             "max_tokens": LONG_MAX_TOKENS, "temperature": 0})
                for i in range(NUM_LONG)]
        chat = client.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": long_prompt(99)[:90]}], "max_tokens": 4})
        window_start = time.monotonic()
        answers = asyncio.ensure_future(asyncio.gather(*long, chat))
        latencies = await probe_health(client, url, slow, answers)
        window_end = time.monotonic()
        texts = await asyncio.gather(*streams)
        arrivals = sorted(t for t, _ in chunks if window_start <= t <= window_end)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        return texts, await answers, latencies, gaps


def test_long_prompts_tokenize_off_the_event_loop_while_streams_run(server, monkeypatch):
    reference_stream = httpx.post(f"{server.url}/v1/completions", json=STREAM, headers=AUTH, timeout=60)
    reference_long = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "tiny", "prompt": [long_prompt(i) for i in range(NUM_LONG)], "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0}).json()["choices"]
    slow = SlowTokenizing(monkeypatch, server.host.tokenizer)
    texts, answers, latencies, gaps = asyncio.run(scenario(server.url, slow))

    assert [r.status_code for r in answers] == [200] * (NUM_LONG + 1)
    assert texts == [reference_stream.json()["choices"][0]["text"]] * NUM_STREAMS
    assert [r.json()["choices"][0]["text"] for r in answers[:NUM_LONG]] == [c["text"] for c in reference_long]
    assert [r.json()["usage"]["prompt_tokens"] for r in answers[:NUM_LONG]] == [len(long_prompt(i).encode())
                                                                             for i in range(NUM_LONG)]
    assert len(slow.calls) == NUM_LONG + 1
    assert all(name.startswith("jaxengine-tokenize") and not shared for name, shared in slow.calls), slow.calls
    # The event loop stayed free and the streams kept flowing. Tokenizing on the loop would block
    # it 17 times for SLOW_S; one pause of the whole process (a full garbage collection on a busy
    # machine) may delay one probe and one chunk, wherever prompts are tokenized.
    assert len(latencies) > NUM_LONG and statistics.median(latencies) < SLOW_S / 8, latencies
    assert sum(latency >= SLOW_S / 2 for latency in latencies) <= 1, latencies
    assert len(gaps) > NUM_STREAMS and statistics.median(gaps) < SLOW_S / 8, gaps
    assert sum(gap >= SLOW_S / 2 for gap in gaps) <= 1, gaps
    server.wait_idle()
