"""The vLLM baseline: the same requests through vLLM's offline ``LLM`` (its CPU build on a CPU
machine), in its own venv and process (``--vllm-python``), with the engine's limits.

vLLM stays out of jaxengine's dependencies: ``vllm_worker.py`` runs under vLLM's interpreter and
talks through two JSON files. vLLM loads Hugging Face folders: for the embedded GGUF model give
``--vllm-model`` a folder made by ``scripts/export_hf_checkpoint.py``. As vLLM's CPU docs ask,
tcmalloc and the venv's Intel OpenMP are preloaded when present; the engine core runs in the
worker's process with an OpenMP thread per CPU (``vllm_env``)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from jaxengine.bench.datasets import BenchRequest

WORKER = Path(__file__).with_name("vllm_worker.py")


def run_vllm(python: str, model: str, requests: list[BenchRequest], engine: dict,
             progress: bool = True) -> tuple[dict, list]:
    """Time the requests through vLLM; returns (figures, generated token ids per request)."""
    check_options(python, model)
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"model": model, "engine": engine,
                                    "prompts": [r.prompt_token_ids for r in requests],
                                    "output_lens": [r.output_len for r in requests]}))
        if progress:
            print(f"vllm baseline: {len(requests)} requests through {python}", flush=True)
        done = subprocess.run([python, str(WORKER), str(spec), str(out)], env=vllm_env(python, in_process=True),
                              stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vllm baseline failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    tokens = result.pop("tokens")
    return {**result, "engine": engine}, tokens


def check_options(python: str | None, model: str | None) -> None:
    """The interpreter and the Hugging Face folder vLLM needs (checked before the engine runs)."""
    if not python:
        raise ValueError("--baseline vllm: needs --vllm-python (vLLM runs in its own venv)")
    if not Path(python).exists():
        raise ValueError(f"--vllm-python: {python} does not exist (a venv's python with vllm installed)")
    if model is None or not (Path(model) / "config.json").exists():
        raise ValueError(f"--vllm-model: {model} is not a Hugging Face folder (no config.json); make one of the "
                         "default model with scripts/export_hf_checkpoint.py")


def vllm_env(python: str, *, in_process: bool = False) -> dict:
    """This environment with vLLM's CPU recommendations added: tcmalloc and the venv's libiomp5 in
    LD_PRELOAD (its server is started with it too, by scripts/serve_vs_vllm.py). ``in_process``
    (the offline baseline): vLLM's engine core in the worker's own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with an OpenMP thread per CPU, unless already set: in
    its own process on the CPU it keeps a core for the scheduler, which on a 2-core machine leaves
    the model one thread (measured: half the output tok/s)."""
    preload = [p for p in (_tcmalloc(), Path(python).resolve().parents[1] / "lib" / "libiomp5.so")
               if p is not None and Path(p).exists()]
    env = dict(os.environ)
    if preload:
        env["LD_PRELOAD"] = ":".join(map(str, preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p]))
    if in_process:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    return env


def _tcmalloc() -> str | None:
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        path = Path(folder) / "libtcmalloc_minimal.so.4"
        if path.exists():
            return str(path)
    return None
