"""Start-up of the server with no flags: how soon a fresh server answers, and how fast it streams
while its step buckets still compile in the background.

Each launch runs `python -m jaxengine.serve` with the persistent XLA cache off
(JAXENGINE_XLA_CACHE=0: every bucket compiles, as on a fresh machine) and streams a 64-token
greedy completion (`ignore_eos`) as soon as the server accepts one. It records the first token,
the whole answer, the gaps between tokens and whether `/health` still reported buckets
compiling when each token arrived; once every bucket is compiled it streams the same request
again: the warm rate of the same launch, the baseline of the rate while compiling. The eager
mode (`--compile-mode eager`: everything compiled before serving) is timed too, as the
baseline for the first answer. The default model must already be in the cache (a first start
downloads it). Modes alternate, --repeats times each.

    python scripts/bench_startup.py [--repeats 1] [--tokens 64] [--port 8190] [-- extra server flags]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def _get_json(url: str, timeout: float = 60) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def _stream(base: str, tokens: int, start: float):
    """Open a streamed completion (retrying until the server accepts it); yields the seconds
    since ``start`` at which each token arrived (a chunk that holds back text for a stop string
    or an unfinished character brings several at once: its logprobs list them)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "logprobs": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    while True:
        try:
            response = urllib.request.urlopen(request, timeout=900)
            break
        except urllib.error.HTTPError:      # the server answered: a refusal is no reason to retry
            raise
        except OSError:                     # not listening yet
            time.sleep(0.2)
    with response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:") and "[DONE]" not in line:
                now = time.perf_counter() - start
                for choice in json.loads(line[5:])["choices"]:
                    yield from [now] * len((choice.get("logprobs") or {}).get("tokens") or [])


class _CompileWatch(threading.Thread):
    """Polls /health: the seconds since ``start`` at which every bucket was compiled."""

    def __init__(self, base: str, start: float):
        super().__init__(daemon=True)
        self.base, self.start_time, self.done_at = base, start, None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if _get_json(f"{self.base}/health").get("all_buckets_compiled"):
                    self.done_at = time.perf_counter() - self.start_time
                    return
            except OSError:
                pass
            time.sleep(0.25)


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def start_once(flags: list[str], port: int, tokens: int) -> dict:
    """One launch: the first streamed answer (while compiling, in background mode), every bucket
    compiled, then the warm answer."""
    env = {**os.environ, "JAXENGINE_XLA_CACHE": "0"}
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jaxengine.serve", "--port", str(port), *flags], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watch = _CompileWatch(base, start)
    try:
        watch.start()
        first = list(_stream(base, tokens, start))
        watch.join(900)
        if watch.done_at is None:
            sys.exit("the step buckets were not all compiled in time")
        warm = list(_stream(base, tokens, start))
        while_compiling = [t for t in first if t < watch.done_at]
        arrivals = sorted(set(while_compiling))
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        return {"first_token_s": round(first[0], 1), "answer_s": round(first[-1], 1), "tokens": len(first),
                "all_buckets_s": round(watch.done_at, 1), "tokens_while_compiling": len(while_compiling),
                "tok_s_while_compiling": round(_rate(while_compiling), 1),
                "median_gap_ms": round(1000 * statistics.median(gaps)) if gaps else None,
                "max_gap_ms": round(1000 * max(gaps)) if gaps else None,
                "warm_tok_s": round(_rate(warm), 1)}
    finally:
        watch.stop.set()
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="tokens in each streamed answer")
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("flags", nargs="*", help="extra server flags (after --)")
    args = parser.parse_args()
    modes = {"background (default)": [], "eager": ["--compile-mode", "eager"]}
    for i in range(args.repeats):
        for name, flags in modes.items():
            row = {"mode": name, "run": i, **start_once([*flags, *args.flags], args.port, args.tokens)}
            ratio = row["tok_s_while_compiling"] / row["warm_tok_s"] if row["tokens_while_compiling"] > 2 else None
            compiling = (f"while compiling {row['tokens_while_compiling']} tokens at {row['tok_s_while_compiling']} "
                         f"tok/s (gaps median {row['median_gap_ms']} ms, max {row['max_gap_ms']} ms, "
                         f"{ratio:.2f}x the warm rate)" if ratio is not None else "no tokens while compiling")
            print(f"{name:22s} run {i}: first token {row['first_token_s']:5.1f} s, {row['tokens']}-token answer "
                  f"{row['answer_s']:5.1f} s, every bucket compiled {row['all_buckets_s']:6.1f} s; {compiling}; "
                  f"warm {row['warm_tok_s']} tok/s", flush=True)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
