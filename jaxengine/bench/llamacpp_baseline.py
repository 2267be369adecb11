"""The llama.cpp baseline: the same requests through ``llama-server`` (``--llamacpp-bin``: the folder
of llama.cpp's built binaries), a subprocess on a free localhost port, with as many parallel slots
as the engine's ``max_num_seqs``, each of the engine's ``max_model_len`` tokens, and continuous
batching.

Every request goes to its native ``/completion`` endpoint at once (up to ``MAX_CLIENTS`` in
flight), as token ids, greedy (``temperature: 0``), ``n_predict`` its output length, with
``ignore_eos`` and ``return_tokens`` (its generated ids, for the agreement check). Its prompt
cache is off (``cache_prompt: false``, ``--cache-ram 0``): every prompt is computed in full. The
time runs from the first request sent to the last response; start-up (loading and warm-up, until
``/health`` answers 200) is timed apart. Where ``ignore_eos`` differs: llama.cpp bans the
end-of-generation tokens, the engine only does not stop at them, so a greedy output that picks
one differs from there.

llama.cpp stays out of jaxengine's dependencies: it runs as its own binary, talked to over HTTP
with the standard library. It loads GGUF files: by default the engine's model when that is one,
else ``--llamacpp-model``."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxengine.bench.datasets import BenchRequest

SERVER = "llama-server"
MAX_CLIENTS = 256           # requests in flight at most (the server queues those beyond its slots)
START_TIMEOUT_S = 600.0     # loading and warming up the model
REQUEST_TIMEOUT_S = 3600.0  # one request, queueing included (the server's own timeout)
STOP_TIMEOUT_S = 10.0       # after SIGTERM, before SIGKILL
LOG_TAIL = 3000             # bytes of the server's log in an error
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))     # localhost: never through a proxy


def check_options(args) -> None:
    """The binaries' folder and the GGUF llama.cpp needs (checked before the engine runs)."""
    if not args.llamacpp_bin:
        raise ValueError("--baseline llamacpp: needs --llamacpp-bin (the folder of llama.cpp's built binaries)")
    server_path(args.llamacpp_bin)
    if args.llamacpp_model is not None:
        if not Path(args.llamacpp_model).is_file():
            raise ValueError(f"--llamacpp-model: {args.llamacpp_model} is not a file (a GGUF model)")
    elif args.model is not None and Path(args.model).suffix != ".gguf":
        raise ValueError(f"--baseline llamacpp: the engine's model {args.model} is not a GGUF file; give llama.cpp "
                         "the same model as one with --llamacpp-model")
    if args.llamacpp_threads is not None and args.llamacpp_threads < 1:
        raise ValueError(f"--llamacpp-threads: {args.llamacpp_threads} (at least 1)")


def server_path(bin_dir: str) -> Path:
    """``llama-server`` in ``bin_dir``; ValueError naming the path when it is not there."""
    folder = Path(bin_dir)
    if not folder.is_dir():
        raise ValueError(f"--llamacpp-bin: {folder} is not a folder (llama.cpp's built binaries, e.g. build/bin)")
    server = folder / SERVER
    if not server.is_file() or not os.access(server, os.X_OK):
        raise ValueError(f"--llamacpp-bin: {server} is not an executable (build llama.cpp's {SERVER} first)")
    return server


def default_threads() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def run_llamacpp(bin_dir: str, model: str, requests: list[BenchRequest], slots: int, slot_len: int,
                 threads: int | None = None, progress: bool = True) -> tuple[dict, list]:
    """Time the requests through ``llama-server`` with ``slots`` parallel slots of ``slot_len``
    tokens each; returns (figures, generated token ids per request)."""
    threads = threads or default_threads()
    port = free_port()
    cmd = [str(server_path(bin_dir)), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * slot_len), "--cont-batching", "-t", str(threads),
           "--no-cache-prompt", "--cache-ram", "0"]
    server = {"model": str(model), "parallel": slots, "ctx_size": slots * slot_len, "threads": threads,
              "command": cmd}
    url = f"http://127.0.0.1:{port}"
    if progress:
        print(f"llamacpp baseline: {len(requests)} requests through {cmd[0]} ({slots} slots, {threads} threads)",
              flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(requests), MAX_CLIENTS)))
        with open(log, "wb") as out:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, log)
            load_s = time.perf_counter() - start
            server["build_info"] = build_info(url)
            start = time.perf_counter()
            responses = list(pool.map(lambda r: complete(url, r, proc, log), requests))
            elapsed = time.perf_counter() - start
        finally:
            stop(proc)                  # first: requests still in flight then fail at once
            pool.shutdown(cancel_futures=True)
    tokens = [r["tokens"] for r in responses]
    return {"elapsed_s": elapsed, "load_s": load_s, "server": server}, tokens


def free_port() -> int:
    """A localhost TCP port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    """Until ``/health`` answers 200 (the model loaded and warmed up); RuntimeError with the
    server's log when it exits or does not answer in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llamacpp baseline: {SERVER} exited with status {proc.returncode} before it was "
                               f"ready:\n{log_tail(log)}")
        try:
            with OPENER.open(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):        # not listening yet, or 503 while loading
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llamacpp baseline: {SERVER} not ready (/health) after {timeout:.0f} s:\n{log_tail(log)}")


def build_info(url: str) -> str | None:
    """The server's ``build_info`` from ``/props`` (None where it does not say)."""
    try:
        with OPENER.open(f"{url}/props", timeout=10) as r:
            return json.load(r).get("build_info")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def complete(url: str, request: BenchRequest, proc: subprocess.Popen, log: Path) -> dict:
    """One request through ``/completion``: its response, checked to hold ``output_len`` token ids."""
    body = {"prompt": request.prompt_token_ids, "n_predict": request.output_len, "temperature": 0.0,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "stream": False}
    req = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with OPENER.open(req, timeout=REQUEST_TIMEOUT_S) as r:
            response = json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"llamacpp baseline: /completion answered {e.code}: {e.read().decode(errors='replace')}"
                           f"\n{log_tail(log)}") from e
    except (urllib.error.URLError, OSError) as e:
        state = "running" if proc.poll() is None else f"exited with status {proc.returncode}"
        raise RuntimeError(f"llamacpp baseline: /completion failed ({e}; {SERVER} {state}):\n{log_tail(log)}") from e
    tokens = response.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != request.output_len:
        got = f"{len(tokens)} token ids" if isinstance(tokens, list) else "no token ids"
        raise RuntimeError(f"llamacpp baseline: /completion returned {got} for n_predict {request.output_len} "
                           f"(stop_type {response.get('stop_type')!r}, truncated {response.get('truncated')!r})")
    return response


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server; kill it when it has not exited after ``STOP_TIMEOUT_S``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(log: Path) -> str:
    """The end of the server's log (its last ``LOG_TAIL`` bytes)."""
    return log.read_bytes()[-LOG_TAIL:].decode(errors="replace")
