"""One engine over two processes on localhost (jax.distributed on the CPU, gloo collectives, two
devices each: tensor parallelism of 4 over the global mesh): the same greedy tokens as one
process, and a process that dies or hangs makes the other exit with an error in bounded time.
Each process is ``tests/parallel/multihost_driver.py`` run with subprocess; every one is killed
in a finally block."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine_args import EngineArgs
from jaxengine.parallel import multihost, step_channel

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(7)
SHARED = RNG.integers(3, 256, 13).tolist()
PROMPTS = [RNG.integers(3, 256, n).tolist() for n in (1, 6, 19, 30)] + [SHARED + [7], SHARED + [9, 4]]
MAX_TOKENS = 10
TIMEOUT = 10            # --distributed-timeout of the jobs, seconds
HUNG_TIMEOUT = 6        # the hung-process job's: it waits out its timeout twice (an idle wait, then the watchdog)
START_S = 240           # most a job may take to start (load and compile, two processes on few cores)
OPTIONS = dict(skip_tokenizer_init=True, token_buckets=[8, 16], request_buckets=[8], max_num_seqs=8,
               max_num_batched_tokens=16, block_size=4, max_model_len=64, num_kv_blocks=16, compile_mode="eager")
OUR_ERROR = "jaxengine: distributed failure on process"
JAX_ERROR = "JAX distributed service detected fatal errors"      # JAX's runtime when process 0 is gone


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("multihost")
    make_checkpoint(folder, "llama", num_attention_heads=8, num_key_value_heads=2)
    return folder


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    """One persistent compilation cache for the module's jobs: the later ones start faster."""
    return tmp_path_factory.mktemp("xla-cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two driver processes; ``log(i)``: their stdout and stderr so far."""

    def __init__(self, tmp_path) -> None:
        self.paths = [tmp_path / f"process{i}.log" for i in range(2)]
        self.procs: list[subprocess.Popen] = []

    def start(self, folder, cache, mode: str, timeout: float = TIMEOUT) -> None:
        port = free_port()
        from tests.conftest import FAST_CPU_COMPILE_FLAGS

        flags = " ".join(["--xla_force_host_platform_device_count=2", *FAST_CPU_COMPILE_FLAGS])
        env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": str(ROOT),
               "JAXENGINE_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
        for i in range(2):
            config = {"mode": mode, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                      "options": {**OPTIONS, "model": str(folder), "distributed_coordinator": f"127.0.0.1:{port}",
                                  "num_processes": 2, "process_id": i, "distributed_timeout": timeout}}
            with self.paths[i].open("w") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_driver",
                                                    json.dumps(config)], cwd=ROOT, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT))

    def log(self, i: int) -> str:
        return self.paths[i].read_text(errors="replace")

    def wait_for(self, i: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(i):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"no {text!r} from process {i}:\n{self.log(0)[-3000:]}\n----\n"
                                     f"{self.log(1)[-3000:]}")
            time.sleep(0.2)

    def wait(self, i: int, timeout: float) -> int:
        try:
            return self.procs[i].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {i} still running after {timeout} s:\n{self.log(i)[-3000:]}") from None

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def job(checkpoint, xla_cache, tmp_path):
    jobs = []

    def start(mode: str, timeout: float = TIMEOUT) -> Job:
        jobs.append(Job(tmp_path))          # registered first: whatever starts is killed below
        jobs[-1].start(checkpoint, xla_cache, mode, timeout)
        return jobs[-1]

    try:
        yield start
    finally:
        for j in jobs:
            j.kill_all()


def test_two_processes_give_the_tokens_of_one(job, checkpoint):
    j = job("generate")
    llm = LLM(checkpoint, progress=False, **OPTIONS)       # one process, one device (while the job starts)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    forked = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
                          use_tqdm=False)[0]
    assert j.wait(0, START_S + 60) == 0, j.log(0)[-3000:]
    assert j.wait(1, 30) == 0, j.log(1)[-3000:]           # stopped by process 0 at its exit
    result = json.loads(next(line for line in j.log(0).splitlines() if line.startswith("{")))
    assert result["tokens"] == expected
    assert result["forked"] == [c.token_ids for c in forked.outputs]
    assert result["mesh_devices"] == 4                     # TP over both processes' devices
    assert result["preemptions"] > 0 and result["num_cpu_blocks"] == 0      # recomputed, not swapped
    assert result["copies"] > 0                            # block copies ran on every process
    assert result["compilations"] == 0 and result["leaked_blocks"] == 0
    assert "(0 compilations after start-up)" in j.log(1)   # the worker compiled nothing after start-up either


def test_a_killed_worker_stops_process_0(job):
    j = job("loop")
    j.wait_for(0, "READY", START_S)
    time.sleep(1)                                          # process 0 is stepping
    j.procs[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    status = j.wait(0, 60)
    print(f"process 0 exited with {status} {time.monotonic() - start:.1f} s after the worker was killed")
    assert status == multihost.FATAL_EXIT_STATUS, j.log(0)[-3000:]
    assert f"{OUR_ERROR} 0 of 2" in j.log(0)
    assert time.monotonic() - start < 60


def test_a_killed_process_0_stops_the_worker(job):
    j = job("idle")
    j.wait_for(0, "READY", START_S)
    j.wait_for(1, "running process 0's steps", 30)
    j.procs[0].send_signal(signal.SIGKILL)
    start = time.monotonic()
    status = j.wait(1, 60)
    print(f"the worker exited with {status} {time.monotonic() - start:.1f} s after process 0 was killed")
    assert status != 0
    assert JAX_ERROR in j.log(1) or OUR_ERROR in j.log(1), j.log(1)[-3000:]
    assert time.monotonic() - start < 60


def test_a_hung_process_0_stops_the_worker_after_the_timeout(job):
    j = job("idle", HUNG_TIMEOUT)
    j.wait_for(0, "READY", START_S)
    j.wait_for(1, "running process 0's steps", 30)
    time.sleep(HUNG_TIMEOUT + 2)                           # process 0's heartbeats keep an idle worker waiting
    assert j.procs[1].poll() is None, j.log(1)[-3000:]
    j.procs[0].send_signal(signal.SIGSTOP)                 # alive but silent: only the watchdog notices
    start = time.monotonic()
    status = j.wait(1, 60)
    elapsed = time.monotonic() - start
    print(f"the worker exited with {status} {elapsed:.1f} s after process 0 was stopped")
    assert status == multihost.FATAL_EXIT_STATUS, j.log(1)[-3000:]
    assert (f"{OUR_ERROR} 1 of 2: waiting for process 0 (its next step or heartbeat) took longer than "
            f"{HUNG_TIMEOUT} s") in j.log(1)
    # The worker's wait began at process 0's last heartbeat, which may precede the stop by up to
    # a heartbeat interval (HUNG_TIMEOUT / 5) plus its polling period (a quarter of that).
    last_heartbeat_s = HUNG_TIMEOUT / 5 * 1.25
    assert HUNG_TIMEOUT - last_heartbeat_s - 0.5 < elapsed < HUNG_TIMEOUT + 20


# ---------------------------------------------------------------- options (no processes started)
def test_the_job_comes_from_flags_or_environment(monkeypatch):
    for env in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
        monkeypatch.delenv(env, raising=False)
    assert multihost.distributed_from(EngineArgs()) is None
    dist = multihost.distributed_from(EngineArgs(distributed_coordinator="10.0.0.1:1234", num_processes=4,
                                                 process_id=3, distributed_timeout=5))
    assert dist == multihost.Distributed("10.0.0.1:1234", 4, 3, 5.0) and dist.is_worker
    monkeypatch.setenv(multihost.ENV_COORDINATOR, "h:1")
    monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(multihost.ENV_PROCESS_ID, "0")
    assert multihost.distributed_from(EngineArgs()) == multihost.Distributed("h:1", 2, 0, 60.0)
    assert multihost.distributed_from(EngineArgs(process_id=1)).process_id == 1       # a flag wins
    monkeypatch.setenv(multihost.ENV_PROCESS_ID, "2")
    with pytest.raises(ValueError, match=r"process_id: must be 0 to 1"):
        multihost.distributed_from(EngineArgs())
    monkeypatch.delenv(multihost.ENV_COORDINATOR)
    with pytest.raises(ValueError, match=r"distributed_coordinator: needed for 2 processes"):
        multihost.distributed_from(EngineArgs())
    with pytest.raises(ValueError, match=r"distributed_timeout: must be > 0"):
        EngineArgs(distributed_timeout=0)


def test_inputs_pack_into_one_buffer_and_back():
    arrays = [np.arange(5, dtype=np.int32), np.array([True, False, True]), np.ones((2, 3), np.float32),
              np.array([[1, 2]], np.uint32)]
    buffer = step_channel._pack(arrays, [4, 16, 64])
    assert buffer.dtype == np.int32 and buffer.shape == (16,)
    back = step_channel._unpack(buffer, [(a.shape, a.dtype) for a in arrays])
    for a, b in zip(arrays, back):
        assert a.dtype == b.dtype and np.array_equal(a, b)
