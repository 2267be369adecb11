"""The vLLM baseline's environment: its offline engine core in the worker's process with an OpenMP
thread per CPU (vLLM's own process keeps one of them for its scheduler), unless already set."""
import os

from jaxengine.bench.vllm_baseline import vllm_env


def test_the_offline_baseline_runs_vllm_in_process_with_a_thread_per_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    python = str(tmp_path / "venv" / "bin" / "python")
    env = vllm_env(python, in_process=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    server = vllm_env(python)                          # its server: vLLM's own defaults
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server and "OMP_NUM_THREADS" not in server
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    kept = vllm_env(python, in_process=True)
    assert (kept["OMP_NUM_THREADS"], kept["VLLM_ENABLE_V1_MULTIPROCESSING"]) == ("1", "1")
