"""What an open dashboard costs the server: output tok/s under a fixed closed-loop load with and
without a poller reading ``GET /dashboard/state`` once a second (as the page does), in
alternating turns (off, on, on, off, ...), several repeats; the medians both ways and their ratio.
The server process's CPU time per 1,000 output tokens is reported too: on a machine shared with
other work it varies far less than wall-clock throughput does.

    python scripts/bench_dashboard.py --tiny --requests 1024
    python scripts/bench_dashboard.py --repeats 3 --screenshot docs/dashboard.png

``python -m jaxengine.serve`` runs in a process of its own (the default model, or with ``--tiny``
the tests' tiny random Llama built with transformers); the clients are httpx streams on loopback,
``--clients`` at a time, each sending its next request when the last one ends; prompts of
``--prompt-len`` random token ids and ``--output-len`` tokens each (ignore_eos, greedy), so every
turn does the same work. The collector's own cost per observer call and per snapshot is printed
first (it runs whether or not anyone looks). ``--screenshot PATH`` also saves the page, in a
headless system Chromium driven by Playwright, while one more turn of the load runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from types import SimpleNamespace

import httpx

from tiny_checkpoint import tiny_checkpoint

from jaxengine.bench.launch import launched_server
from jaxengine.bench.serve import discover_model, run_load
from jaxengine.engine_args import EngineArgs

SAMPLING = {"ignore_eos": True, "temperature": 0}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def collector_cost() -> dict:
    """Microseconds per observer call and milliseconds per snapshot with full sample buffers."""
    from jaxengine.engine import StepTrace
    from jaxengine.serve.dashboard import MAX_SAMPLES, DashboardCollector

    fields = {name: 0 for name in StepTrace.__dataclass_fields__ if name != "expert_tokens"}
    engine = SimpleNamespace(last_trace=StepTrace(**{**fields, "kv_usage": 0.5}))
    request = SimpleNamespace(times=SimpleNamespace(queued=0.0, first_token=0.1))
    c, n = DashboardCollector(), 100_000
    start = time.perf_counter()
    for _ in range(n):
        c.on_step(engine)
    per_step = (time.perf_counter() - start) / n
    itls = [random.random() * 0.02 if i % 50 else None for i in range(n)]     # each 50th: a first token
    start = time.perf_counter()
    for itl in itls:
        c.on_tokens(request, 1, itl)
    per_tokens = (time.perf_counter() - start) / n
    assert c.snapshot()["latency_s"]["itl"]["count"] == MAX_SAMPLES
    start = time.perf_counter()
    for _ in range(10):
        json.dumps(c.snapshot())
    return {"on_step_us": round(per_step * 1e6, 2), "on_tokens_us": round(per_tokens * 1e6, 2),
            "snapshot_and_json_ms": round((time.perf_counter() - start) / 10 * 1e3, 2)}


async def poller(url: str, interval: float, stop: asyncio.Event, polls: list[int]) -> None:
    """Read the dashboard's state every ``interval`` seconds (the open page: once a second)."""
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            r = await client.get(f"{url}/dashboard/state")
            r.raise_for_status()
            r.json()
            polls[0] += 1
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


async def closed_loop(url: str, args, prompts: list) -> tuple[list, float]:
    """``args.clients`` clients, each sending its next request when its last one ends."""
    return await run_load(f"{url}/v1", [(p, args.output_len) for p in prompts], model=args.served_model,
                          max_concurrency=args.clients, extra_body=SAMPLING, progress=False)


async def turn(url: str, pid: int, args, prompts: list, polling: bool) -> dict:
    stop, polls = asyncio.Event(), [0]
    cpu_before = cpu_seconds(pid)
    task = asyncio.create_task(poller(url, args.poll_interval, stop, polls)) if polling else None
    results, duration = await closed_loop(url, args, prompts)
    stop.set()
    if task is not None:
        await task
    tokens = sum(r.output_tokens for r in results)
    return {"polling": polling, "output_tok_s": tokens / duration, "duration_s": duration,
            "server_cpu_ms_per_1k_tokens": round((cpu_seconds(pid) - cpu_before) / tokens * 1e6, 2),
            "polls": polls[0], "failed": sum(not r.ok for r in results)}


def screenshot(url: str, args, prompts: list, path: str) -> None:
    """The page in a headless system Chromium, a few seconds into a turn of the load."""
    from playwright.sync_api import sync_playwright

    load = threading.Thread(target=lambda: asyncio.run(closed_loop(url, args, prompts)))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/dashboard")
        load.start()
        time.sleep(args.screenshot_after)
        page.screenshot(path=path, full_page=True)
        browser.close()
    load.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tiny", action="store_true", help="serve the tests' tiny random Llama")
    parser.add_argument("--repeats", type=int, default=4,
                        help="pairs of turns, one without and one with the poller (0: only the screenshot)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="requests per turn")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls (the page: 1)")
    parser.add_argument("--screenshot", default=None, help="save a screenshot of the page under load here")
    parser.add_argument("--screenshot-after", type=float, default=20.0, help="seconds into the load")
    args = parser.parse_args()
    print(json.dumps({"collector": collector_cost()}), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        engine_args = EngineArgs(model=tiny_checkpoint(folder) if args.tiny else args.model,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                 max_model_len=1024, compile_mode="eager")     # steady serving from the start
        with launched_server(engine_args) as server:
            url, pid = server.api_url.removesuffix("/v1"), server.pid
            args.served_model = discover_model(server.api_url)
            rng, top = random.Random(0), 256 if args.tiny else 1000      # ordinary tokens of either vocabulary

            def prompts(n: int) -> list[list[int]]:
                return [[rng.randrange(1, top) for _ in range(args.prompt_len)] for _ in range(n)]

            asyncio.run(turn(url, pid, args, prompts(2 * args.clients), polling=False))      # warm-up
            rows = []
            for r in range(args.repeats):
                for polling in ((False, True) if r % 2 == 0 else (True, False)):
                    rows.append(asyncio.run(turn(url, pid, args, prompts(args.requests), polling)))
                    print(json.dumps(rows[-1]), flush=True)
            if args.screenshot:
                screenshot(url, args, prompts(args.requests), args.screenshot)
    if rows:
        report(rows)


def report(rows: list[dict]) -> None:
    """Medians both ways, their ratio (with / without), and the ratio within each pair of turns."""
    summary = {}
    for key in ("output_tok_s", "server_cpu_ms_per_1k_tokens"):
        without = statistics.median(r[key] for r in rows if not r["polling"])
        with_poller = statistics.median(r[key] for r in rows if r["polling"])
        pairs = [(b[key] / a[key]) if b["polling"] else (a[key] / b[key]) for a, b in zip(rows[::2], rows[1::2])]
        summary[key] = {"median_without": without, "median_with": with_poller,
                        "ratio_of_medians": round(with_poller / without, 4),
                        "median_paired_ratio": round(statistics.median(pairs), 4),
                        "paired_ratios": [round(x, 3) for x in pairs]}
    summary["total_failed"] = sum(r["failed"] for r in rows)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
