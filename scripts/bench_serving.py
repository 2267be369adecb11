"""Serving benchmark: the OpenAI server on the default model, streamed completions arriving as
a Poisson process at a few request rates; request throughput, output tok/s, TTFT, TPOT, ITL.

    python scripts/bench_serving.py [--rates 0.5 2] [--requests 48] [--prompt-len 128] [--output-len 64]

The server runs in this process (a uvicorn thread, the engine in its own thread); clients are
httpx streams on loopback. Prompts are random token ids (fixed length), outputs fixed with
ignore_eos, so every rate does the same work.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    server, url, vocab = start_server(args)
    rng = random.Random(0)
    for rate in args.rates:
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        stats = asyncio.run(run_rate(url, rate, prompts, args.output_len))
        print(json.dumps(stats), flush=True)
    server.should_exit = True


if __name__ == "__main__":
    main()
