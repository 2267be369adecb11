"""Serving benchmark on a server this script starts: ``jaxengine.bench.serve`` (the load
generator of ``python -m jaxengine.bench serve``) at a few Poisson request rates, or closed-loop
at rising concurrency. Prompts are random token ids (fixed length), outputs fixed with
``ignore_eos``, so every level does the same work. One JSON line per level.

    python scripts/bench_serving.py [--rates 0.5 2] [--requests 48] [--prompt-len 128] [--output-len 64]

The server runs in this process on the default model (a uvicorn thread, the engine in its own
thread); clients are httpx streams on loopback.

``--sweep`` measures degradation under overload instead: closed-loop clients (each sends its
next request when the previous one ends) at concurrency 1, 2, 4, ... up to ``--max-concurrency``
against ``python -m jaxengine.serve`` in a process of its own (so the clients do not compete with
it for the interpreter), then the throughput at the highest level relative to the peak.
``--tiny`` serves a tiny random Llama (built with transformers, the test extra) instead:

    python scripts/bench_serving.py --sweep --tiny

``--plot-dir DIR`` also writes each level's figures (latency CDFs, tokens per second).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jaxengine.bench import plots, serve

SERVED_NAME = "bench"
SAMPLING = {"ignore_eos": True, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_thread(args):
    """The default model served in this process; -> (uvicorn server, API root, vocabulary size)."""
    import uvicorn

    from jaxengine.llm import LLM
    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=1024)
    metrics = EngineMetrics(SERVED_NAME)
    app = build_app(AsyncEngine(llm, observer=metrics), served_model_name=SERVED_NAME, metrics=metrics)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}/v1", llm.model_config.vocab_size


def start_server_process(args, model: str | None):
    """``python -m jaxengine.serve`` in a process of its own; -> (process, API root)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxengine.serve", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", "1024", "--log-level", "warning"]
    if model is not None:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(f"  server: {line.rstrip()}", file=sys.stderr, flush=True)
        if f"serving {SERVED_NAME} at" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()    # keep the pipe drained
            return proc, f"http://127.0.0.1:{port}/v1"
    raise RuntimeError(f"the server exited with status {proc.wait()} before serving")


def tiny_checkpoint(folder: str) -> str:
    """The tests' tiny random Llama with a byte tokenizer (needs torch and transformers)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.conftest import make_chat_checkpoint

    make_chat_checkpoint(folder)
    return folder


def row(level: dict, result: dict) -> dict:
    """The figures of one level that BENCHMARKS.md tabulates, rounded."""
    out = {**level, "requests": result["num_requests"], "duration_s": round(result["duration_s"], 2),
           "request_throughput": round(result["request_throughput"], 3),
           "output_tok_s": round(result["output_throughput"], 1), "failed": result["failed"]}
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        out[key] = {k: round(result[key][k], 1) for k in ("mean", "median", "p99") if result[key][k] is not None}
    return out


def measure(url: str, prompts, level: dict, args, **load) -> dict:
    result = serve.benchmark(url, prompts, model=SERVED_NAME, extra_body=SAMPLING, progress=False, **load)
    if args.plot_dir:
        tag = "_".join(f"{k}{v}" for k, v in level.items())
        plots.plot_result(result, os.path.join(args.plot_dir, tag))
    summary = row(level, result)
    print(json.dumps(summary), flush=True)
    return summary


def rates(args) -> None:
    server, url, vocab = start_server_thread(args)
    for i, rate in enumerate(args.rates):
        prompts = serve.random_token_prompts(args.requests, args.prompt_len, args.output_len, 100, vocab, seed=i)
        measure(url, prompts, {"rate": rate}, args, request_rate=rate)
    server.should_exit = True


def sweep(args) -> None:
    levels = [1 << i for i in range(args.max_concurrency.bit_length()) if 1 << i <= args.max_concurrency]
    top = 256 if args.tiny else 1000          # ordinary tokens of either vocabulary
    with tempfile.TemporaryDirectory() as folder:
        proc, url = start_server_process(args, tiny_checkpoint(folder) if args.tiny else args.model)
        try:
            warm_up = serve.random_token_prompts(16, args.prompt_len, args.output_len, 1, top, seed=0)
            serve.benchmark(url, warm_up, model=SERVED_NAME, extra_body=SAMPLING, progress=False,
                            max_concurrency=min(8, levels[-1]))
            rows = []
            for c in levels:
                n = max(args.requests_per_client * c, args.min_requests)
                prompts = serve.random_token_prompts(n, args.prompt_len, args.output_len, 1, top, seed=c)
                rows.append(measure(url, prompts, {"concurrency": c}, args, max_concurrency=c))
        finally:
            proc.terminate()
            proc.wait(60)
    peak, last = max(rows, key=lambda r: r["output_tok_s"]), rows[-1]
    print(json.dumps({"peak_concurrency": peak["concurrency"], "peak_output_tok_s": peak["output_tok_s"],
                      "last_concurrency": last["concurrency"], "last_output_tok_s": last["output_tok_s"],
                      "last_relative_to_peak": round(last["output_tok_s"] / peak["output_tok_s"], 3),
                      "total_failed": sum(r["failed"] for r in rows)}), flush=True)


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
    parser.add_argument("--plot-dir", default=None, help="write each level's figures under this folder")
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
    else:
        rates(args)


if __name__ == "__main__":
    main()
