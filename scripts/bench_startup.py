"""Start-up of the server with no flags: seconds from launching `python -m jaxengine.serve` to its
first completed /v1/completions answer (5 tokens, greedy) and to every step bucket compiled,
with the persistent XLA cache off (JAXENGINE_XLA_CACHE=0: every bucket compiles, as on a fresh
machine), for the default background compilation and, as the baseline in the same run,
`--compile-mode eager` (everything compiled before serving). The default model must already
be in the cache (a first start downloads it). Modes alternate, --repeats times each.

    python scripts/bench_startup.py [--repeats 2] [--port 8190] [-- extra server flags]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}


def _get_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def _wait_for_answer(proc: subprocess.Popen, base: str) -> dict:
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode}")
        try:
            return _get_json(f"{base}/v1/completions", PROMPT)
        except OSError:
            time.sleep(0.2)


def _wait_for_all_buckets(base: str, limit_s: float = 900) -> None:
    deadline = time.monotonic() + limit_s
    while not _get_json(f"{base}/health").get("all_buckets_compiled"):
        if time.monotonic() > deadline:
            sys.exit("the step buckets were not all compiled in time")
        time.sleep(0.5)


def start_once(flags: list[str], port: int) -> dict:
    """One launch: seconds to the first answer and to every bucket compiled."""
    env = {**os.environ, "JAXENGINE_XLA_CACHE": "0"}
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jaxengine.serve", "--port", str(port), *flags], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answer = _wait_for_answer(proc, base)
        first_s = time.perf_counter() - start
        _wait_for_all_buckets(base)
        return {"first_answer_s": round(first_s, 1), "all_buckets_s": round(time.perf_counter() - start, 1),
                "text": answer["choices"][0]["text"]}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("flags", nargs="*", help="extra server flags (after --)")
    args = parser.parse_args()
    modes = {"background (default)": [], "eager": ["--compile-mode", "eager"]}
    for i in range(args.repeats):
        for name, flags in modes.items():
            row = {"mode": name, "run": i, **start_once([*flags, *args.flags], args.port)}
            print(f"{name:22s} run {i}: first answer {row['first_answer_s']:6.1f} s, every bucket compiled "
                  f"{row['all_buckets_s']:6.1f} s ({row['text']!r})", flush=True)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
