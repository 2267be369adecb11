"""The servers, one after the other, under vLLM's own load generator (``vllm bench serve``):
jaxengine's ``python -m jaxengine.serve`` with no flags but ``--max-model-len`` and the port (the
default model's int4 GGUF), the same with ``--quantization none`` (float32, vLLM's format), ``vllm
serve`` on the same model (a Hugging Face folder) with the same limits, and, with
``--llamacpp-bin``, llama.cpp's ``llama-server`` on the same GGUF with continuous batching and one
slot per concurrent request, each alone with the client, at each ``--concurrency``. Prints and
writes one JSON of the figures.

    python scripts/serve_vs_vllm.py --vllm-python V/bin/python --vllm-model HF_FOLDER \\
        [--llamacpp-bin DIR] [--concurrency 16,1] [--num-prompts 64] \\
        [--result-file bench_results/serve_vs_vllm.json]

vLLM needs the venv described in BENCHMARKS.md ("Against vLLM on the same machine"), with a
``vllm-<version>.dist-info/METADATA`` naming the distribution ``vllm`` so that its CLI starts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from jaxengine.bench.vllm_baseline import vllm_env as peer_env
from jaxengine.default_model import default_model_path

PORT = 8011
LOAD = ["--backend", "vllm", "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
        "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
LIMITS = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=512)
FIGURES = ("completed", "failed", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
           "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "duration")


def jaxengine_server(*extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxengine.serve", "--max-model-len", str(LIMITS["max_model_len"]),
            "--port", str(PORT), "--served-model-name", "model", *extra]


def llamacpp_server(bin_dir: str, gguf: Path, slots: int) -> list[str]:
    """``llama-server`` on the GGUF: ``slots`` sequences at once, each with the others' context
    length, continuous batching (its default), the machine's cores."""
    return [str(Path(bin_dir) / "llama-server"), "-m", str(gguf), "--port", str(PORT), "--alias", "model",
            "-np", str(slots), "-c", str(slots * LIMITS["max_model_len"]), "-b", str(LIMITS["max_num_batched_tokens"]),
            "-t", str(os.cpu_count()), "--cont-batching"]


def vllm_server(vllm_python: str, model: str, kv_bytes: int) -> list[str]:
    return [str(Path(vllm_python).parent / "vllm"), "serve", model, "--port", str(PORT), "--served-model-name",
            "model", "--dtype", "float32", "--max-model-len", str(LIMITS["max_model_len"]),
            "--max-num-seqs", str(LIMITS["max_num_seqs"]), "--max-num-batched-tokens",
            str(LIMITS["max_num_batched_tokens"]), "--kv-cache-memory-bytes", str(kv_bytes)]


def wait_ready(proc: subprocess.Popen, timeout: float = 900) -> None:
    """Until the server answers /health (and, for jaxengine, has compiled every step bucket)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as r:
                body = r.read()
            # jaxengine's health says whether every step bucket is compiled yet; vLLM's is empty
            if not body or json.loads(body).get("all_buckets_compiled", True):
                return
        except (OSError, ValueError):
            pass
        time.sleep(2)
    raise TimeoutError("the server was not ready in time")


def warm(vllm: str, tokenizer: str, env: dict) -> None:
    """A few requests first, so neither server's first compiles fall in the measurement."""
    subprocess.run([vllm, "bench", "serve", *LOAD, "--base-url", f"http://127.0.0.1:{PORT}", "--model", "model",
                    "--tokenizer", tokenizer, "--num-prompts", "8", "--max-concurrency", "8", "--seed", "1"],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def measure(server: list[str], server_env: dict, vllm: str, tokenizer: str, concurrency: list[int],
            num_prompts: int, client_env: dict, log: Path) -> dict:
    figures = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(server, env=server_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.monotonic()
        wait_ready(proc)
        figures["ready_s"] = round(time.monotonic() - started, 1)
        warm(vllm, tokenizer, client_env)
        for c in concurrency:
            with tempfile.TemporaryDirectory() as d:
                subprocess.run([vllm, "bench", "serve", *LOAD, "--base-url", f"http://127.0.0.1:{PORT}",
                                "--model", "model", "--tokenizer", tokenizer, "--num-prompts", str(num_prompts),
                                "--seed", str(100 + c),      # prompts of their own: none in a prefix cache
                                "--max-concurrency", str(c), "--save-result", "--result-dir", d,
                                "--result-filename", "r.json"], check=True, env=client_env)
                result = json.loads((Path(d) / "r.json").read_text())
            figures[f"concurrency {c}"] = {k: result.get(k) for k in FIGURES}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--vllm-model", required=True, help="a Hugging Face folder of the default model")
    p.add_argument("--vllm-kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--llamacpp-bin", help="a folder holding llama.cpp's llama-server (BENCHMARKS.md: its build)")
    p.add_argument("--concurrency", default="16,1")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--only", choices=("jaxengine", "jaxengine-f32", "vllm", "llama.cpp"), default=None)
    p.add_argument("--result-file", default="bench_results/serve_vs_vllm.json")   # beside the bench tool's
    args = p.parse_args()
    Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
    vllm = str(Path(args.vllm_python).parent / "vllm")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    client_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    vllm_env = peer_env(args.vllm_python)
    result = {"load": LOAD, "num_prompts": args.num_prompts, "limits": LIMITS}
    runs = {"jaxengine": [(jaxengine_server(), dict(os.environ), concurrency)],
            "jaxengine-f32": [(jaxengine_server("--quantization", "none"), dict(os.environ), concurrency)],
            "vllm": [(vllm_server(args.vllm_python, args.vllm_model, args.vllm_kv_cache_bytes), vllm_env, concurrency)]}
    if args.llamacpp_bin:           # a server per concurrency: as many slots as requests at once
        runs["llama.cpp"] = [(llamacpp_server(args.llamacpp_bin, default_model_path(), c), dict(os.environ), [c])
                             for c in concurrency]
    for name, servers in runs.items():
        if args.only in (None, name):
            result[name] = {}
            for server, env, levels in servers:
                result[name].update(measure(server, env, vllm, args.vllm_model, levels, args.num_prompts, client_env,
                                            Path(args.result_file).with_suffix(f".{name}.log")))
            print(name, json.dumps(result[name], indent=1), flush=True)
    Path(args.result_file).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
