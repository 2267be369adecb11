"""A server of this engine started for one benchmark run: ``python -m jaxengine.serve`` in a
process of its own (so the load generator does not compete with it for the interpreter), on a
free loopback port, with the given engine options. It is ready when it announces its URL: the
engine compiles every step bucket before that, so no compile lands inside the measurement.
"""
from __future__ import annotations

import collections
import contextlib
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from jaxengine.engine_args import EngineArgs

START_TIMEOUT_S = 1800          # loading and compiling a large model on a CPU takes minutes
READY_LINE = "jaxengine: serving "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine_args: EngineArgs, port: int) -> list[str]:
    """The server's command line."""
    return [sys.executable, "-m", "jaxengine.serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *engine_args.to_cli_args()]


@dataclass(frozen=True)
class LaunchedServer:
    api_url: str        # the OpenAI API root, http://127.0.0.1:PORT/v1
    pid: int


@contextlib.contextmanager
def launched_server(engine_args: EngineArgs, start_timeout_s: float = START_TIMEOUT_S):
    """Within: the running server (``LaunchedServer``); stopped on exit.
    A server that exits or stays silent before it is ready raises RuntimeError with its last
    lines of output."""
    port = free_port()
    proc = subprocess.Popen(server_command(engine_args, port), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(proc, start_timeout_s)
        yield LaunchedServer(f"http://127.0.0.1:{port}/v1", proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until_ready(proc: subprocess.Popen, timeout_s: float) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=20)
    ready = threading.Event()

    def read() -> None:             # keeps the pipe drained for the server's whole life
        for line in proc.stdout:
            tail.append(line.rstrip())
            if line.startswith(READY_LINE):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            what = f"exited with status {proc.returncode}" if proc.returncode is not None else \
                f"was not ready after {timeout_s:.0f} s"
            reader.join(1.0)            # its last words
            raise RuntimeError(f"the launched server {what}; its last output:\n" + "\n".join(tail))
