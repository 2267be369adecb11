"""The processes other than 0 of a distributed job: join it, load the model's share, compile the
same steps, then run process 0's steps (received through the step channel) until it stops.

``join_job`` is the command-line doors' entry (``python -m jaxengine.serve``, ``python -m
jaxengine.generate``); ``run_worker`` is the offline API's, for a program whose process 0 runs
``LLM``.
"""
from __future__ import annotations

import logging
import sys

import jax

from jaxengine.host import EngineHost
from jaxengine.parallel.multihost import initialize, num_compilations
from jaxengine.parallel.step_channel import HEARTBEAT, RESET, STOP, StepChannel

logger = logging.getLogger(__name__)


class Worker:
    """A process other than 0: runs process 0's steps on its devices until told to stop."""

    def __init__(self, runner, channel: StepChannel) -> None:
        self.runner, self.channel = runner, channel

    def run(self) -> None:
        runner, channel = self.runner, self.channel
        compilations = num_compilations()
        pending = None          # the last launched step's tokens: at most one step in flight
        steps = 0
        while True:
            command, moves, inputs = channel.receive()
            if command == HEARTBEAT:
                continue
            if command == STOP:
                break
            if command == RESET:
                runner.reset_previous_tokens()
                continue
            with channel.watchdog.guard(f"launching step {channel.num_steps}"):
                result = runner.launch(moves, inputs)
            if pending is not None:
                with channel.watchdog.guard(f"step {channel.num_steps - 1} on the devices"):
                    jax.block_until_ready(pending)
            pending = result[2] if result is not None else pending
            steps += inputs is not None
        if pending is not None:
            with channel.watchdog.guard("the last step on the devices"):
                jax.block_until_ready(pending)
        logger.info("process %d: stopped by process 0 after %d steps (%d compilations after start-up)",
                    channel.dist.process_id, steps, num_compilations() - compilations)


def join_job(engine_args, program: str) -> int | None:
    """For a command-line door: join the distributed job (before any other JAX use). Returns
    the exit status when this process is done (an invalid job: 2; a worker: once process 0
    stops), or None when it goes on as process 0 or alone."""
    try:
        dist = initialize(engine_args)
    except ValueError as error:
        print(f"{program}: {error}", file=sys.stderr)
        return 2
    if dist is not None and dist.is_worker:        # process 0 schedules and serves; the others run its steps
        return run_worker(engine_args, progress=True)
    return None


def run_worker(engine_args, *, progress: bool = False) -> int:
    """The entry point of a process other than 0: join the job, load the model's share and
    compile the same steps, then run process 0's steps until it stops (returns 0) or is gone
    (the process exits with ``multihost.FATAL_EXIT_STATUS``, or JAX's runtime ends it)."""
    dist = initialize(engine_args)
    if dist is None or not dist.is_worker:
        raise ValueError("run_worker: for processes other than 0 of a distributed job (--distributed-coordinator, "
                         "--num-processes, --process-id > 0); process 0 runs LLM or the server")
    print(f"jaxengine: process {dist.process_id} of {dist.num_processes}: loading the model's share and "
          f"compiling...", flush=True)
    host = EngineHost.for_worker(engine_args, progress=progress)
    print(f"jaxengine: process {dist.process_id} of {dist.num_processes}: running process 0's steps "
          f"(stops with an error if it is silent for {dist.timeout:g} s)", flush=True)
    Worker(host.runner, host.channel).run()
    print(f"jaxengine: process {dist.process_id}: stopped by process 0", flush=True)
    return 0
