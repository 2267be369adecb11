"""Serving benchmark: the OpenAI server on the default model, streamed completions arriving as
a Poisson process at a few request rates; request throughput, output tok/s, TTFT, TPOT, ITL.

    python scripts/bench_serving.py [--rates 0.5 2] [--requests 48] [--prompt-len 128] [--output-len 64]

The server runs in this process (a uvicorn thread, the engine in its own thread); clients are
httpx streams on loopback. Prompts are random token ids (fixed length), outputs fixed with
ignore_eos, so every rate does the same work.

``--sweep`` measures degradation under overload instead: closed-loop clients (each sends its
next request when the previous one ends) at concurrency 1, 2, 4, ... up to ``--max-concurrency``
against ``python -m jaxengine.serve`` in a process of its own (so the clients do not compete with
it for the interpreter), one JSON line per level (requests/s, output tok/s, TTFT and ITL p50/p99,
5xx count), then the throughput at the highest level relative to the peak. ``--tiny`` serves a
tiny random Llama (built with transformers, the test extra) instead of the default model:

    python scripts/bench_serving.py --sweep --tiny
    python scripts/bench_serving.py --sweep
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
import uvicorn


def start_server(args):
    from jaxengine.llm import LLM
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=1024)
    metrics = EngineMetrics("bench")
    app = build_app(AsyncEngine(llm, observer=metrics), served_model_name="bench", metrics=metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}", llm.model_config.vocab_size


async def one_request(client, url, prompt, output_len) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals}


async def run_rate(url, rate, prompts, output_len) -> dict:
    rng = np.random.default_rng(0)
    gaps = rng.exponential(1.0 / rate, len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        begin = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(one_request(client, url, prompt, output_len)))
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - begin
    return summarise(rate, results, duration, output_len)


def summarise(rate, results, duration, output_len) -> dict:
    ttft = np.array([r["arrivals"][0] - r["start"] for r in results]) * 1e3
    tpot = np.array([(r["arrivals"][-1] - r["arrivals"][0]) / max(len(r["arrivals"]) - 1, 1) for r in results]) * 1e3
    itl = np.concatenate([np.diff(r["arrivals"]) for r in results]) * 1e3
    stats = {"rate": rate, "requests": len(results), "duration_s": round(duration, 1),
             "request_throughput": round(len(results) / duration, 3),
             "output_tok_s": round(len(results) * output_len / duration, 1)}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        stats[name] = {"mean": round(float(values.mean()), 1), "p50": round(float(np.percentile(values, 50)), 1),
                       "p99": round(float(np.percentile(values, 99)), 1)}
    return stats


# ---- sweep: closed-loop clients at rising concurrency, server in its own process ----
def start_server_process(args, model: str | None):
    port = free_port()
    cmd = [sys.executable, "-m", "jaxengine.serve", "--port", str(port), "--served-model-name", "bench",
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", "1024", "--log-level", "warning"]
    if model is not None:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(f"  server: {line.rstrip()}", file=sys.stderr, flush=True)
        if "serving bench at" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()    # keep the pipe drained
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"the server exited with status {proc.wait()} before serving")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_checkpoint(folder: str) -> str:
    """The tests' tiny random Llama with a byte tokenizer (needs torch and transformers)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.conftest import make_chat_checkpoint

    make_chat_checkpoint(folder)
    return folder


async def closed_loop(url: str, concurrency: int, prompts: list, output_len: int) -> dict:
    """``concurrency`` clients share the prompts, each sending its next one when the last ends."""
    todo, results = iter(prompts), []

    async def client_loop(client):
        for prompt in todo:
            results.append(await one_sweep_request(client, url, prompt, output_len))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=1.0)          # below the server's 5 s: no reuse of a closing connection
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        begin = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        duration = time.perf_counter() - begin
    return summarise_level(concurrency, results, duration)


async def one_sweep_request(client, url, prompt, output_len) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start, arrivals, tokens = time.perf_counter(), [], 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"status": chunk["error"].get("code", 500), "arrivals": arrivals, "start": start}
                    if chunk["choices"]:
                        arrivals.append(time.perf_counter())     # a chunk may carry several tokens
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return {"status": r.status_code, "arrivals": arrivals, "start": start, "tokens": tokens}
    except httpx.HTTPError:
        return {"status": 599, "arrivals": arrivals, "start": start}     # no answer at all


def summarise_level(concurrency: int, results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["arrivals"]]
    ttft = np.array([r["arrivals"][0] - r["start"] for r in ok] or [np.nan]) * 1e3
    itl = np.concatenate([np.diff(r["arrivals"]) for r in ok] + [np.array([np.nan])]) * 1e3
    stats = {"concurrency": concurrency, "requests": len(results), "duration_s": round(duration, 2),
             "request_throughput": round(len(ok) / duration, 2),
             "output_tok_s": round(sum(r.get("tokens", 0) for r in ok) / duration, 1),
             "5xx": sum(r["status"] >= 500 for r in results)}
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl[~np.isnan(itl)] if len(itl) > 1 else itl)):
        stats[name] = {"p50": round(float(np.nanpercentile(values, 50)), 1),
                       "p99": round(float(np.nanpercentile(values, 99)), 1)}
    return stats


def sweep(args) -> None:
    levels = [1 << i for i in range(args.max_concurrency.bit_length()) if 1 << i <= args.max_concurrency]
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_checkpoint(folder) if args.tiny else args.model
        proc, url = start_server_process(args, model)
        try:
            rng, top = random.Random(0), 256 if args.tiny else 1000     # ordinary tokens of either vocabulary

            def prompts(n: int) -> list[list[int]]:
                return [[rng.randrange(1, top) for _ in range(args.prompt_len)] for _ in range(n)]

            asyncio.run(closed_loop(url, min(8, levels[-1]), prompts(16), args.output_len))      # warm-up
            rows = []
            for c in levels:
                n = max(args.requests_per_client * c, args.min_requests)
                rows.append(asyncio.run(closed_loop(url, c, prompts(n), args.output_len)))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    peak = max(rows, key=lambda r: r["output_tok_s"])
    last = rows[-1]
    print(json.dumps({"peak_concurrency": peak["concurrency"], "peak_output_tok_s": peak["output_tok_s"],
                      "last_concurrency": last["concurrency"], "last_output_tok_s": last["output_tok_s"],
                      "last_relative_to_peak": round(last["output_tok_s"] / peak["output_tok_s"], 3),
                      "total_5xx": sum(r["5xx"] for r in rows)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--sweep", action="store_true", help="closed-loop concurrency sweep (see above)")
    parser.add_argument("--tiny", action="store_true", help="sweep: serve a tiny random Llama")
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--requests-per-client", type=int, default=4, help="sweep: requests per client per level")
    parser.add_argument("--min-requests", type=int, default=32, help="sweep: fewest requests per level")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
        return
    server, url, vocab = start_server(args)
    rng = random.Random(0)
    for rate in args.rates:
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        stats = asyncio.run(run_rate(url, rate, prompts, args.output_len))
        print(json.dumps(stats), flush=True)
    server.should_exit = True


if __name__ == "__main__":
    main()
