"""One engine over several processes (hosts): joining the job (``jax.distributed``), the options
as the job runs them, and the end of a process whose peer is gone.

Every process holds a share of the model and of the KV cache (tensor parallelism over all the
job's devices) and runs the same compiled steps. Process 0 alone schedules, tokenizes and serves;
it sends each step to the others through a ``step_channel.StepChannel``, and they run it in the
worker loop (``jaxengine.multihost_worker``).

A distributed failure (a step, broadcast or wait past ``distributed_timeout``, or a collective
that fails) ends the process with a message naming what failed and status ``FATAL_EXIT_STATUS``
(``os._exit``: a collective blocked in C++ cannot be interrupted, and JAX's shutdown barrier
would wait for the dead peer). When process 0 itself dies, the others stop at once: their
broadcast fails, or JAX's distributed runtime (whose coordinator lives in process 0) ends them
("Terminating process because the JAX distributed service detected fatal errors"), whichever
comes first.

Swapping KV blocks to host memory is off across processes (each would have to move its own
shards): preemption recomputes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXENGINE_COORDINATOR"
ENV_NUM_PROCESSES = "JAXENGINE_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXENGINE_PROCESS_ID"
FATAL_EXIT_STATUS = 3
INITIALIZATION_TIMEOUT_S = 300        # all processes must have connected by then


@dataclass(frozen=True)
class Distributed:
    """Where this process stands in a distributed job."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout: float

    @property
    def is_worker(self) -> bool:
        return self.process_id != 0


_current: Distributed | None = None


def distributed_from(args) -> Distributed | None:
    """The job the options (``EngineArgs``) or the environment describe; None for one process."""
    coordinator = args.distributed_coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _int_option(args.num_processes, ENV_NUM_PROCESSES, "num_processes")
    process_id = _int_option(args.process_id, ENV_PROCESS_ID, "process_id")
    if coordinator is None and num_processes in (None, 1):
        if process_id not in (None, 0):
            raise ValueError(f"process_id: {process_id} given without --distributed-coordinator "
                             f"(or ${ENV_COORDINATOR}) and --num-processes")
        return None
    if coordinator is None:
        raise ValueError(f"distributed_coordinator: needed for {num_processes} processes: host:port of "
                         f"process 0 (or ${ENV_COORDINATOR})")
    if ":" not in coordinator:
        raise ValueError(f"distributed_coordinator: must be host:port, got {coordinator!r}")
    if num_processes is None or num_processes < 1:
        raise ValueError(f"num_processes: needed with --distributed-coordinator (or ${ENV_NUM_PROCESSES}), "
                         f"got {num_processes!r}")
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id: must be 0 to {num_processes - 1} (or ${ENV_PROCESS_ID}), got {process_id!r}")
    if num_processes == 1:
        return None
    return Distributed(coordinator, num_processes, process_id, float(args.distributed_timeout))


def _int_option(value, env: str, name: str) -> int | None:
    if value is not None:
        return int(value)
    text = os.environ.get(env)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}: ${env} must be an integer, got {text!r}") from None


def initialize(args) -> Distributed | None:
    """Join the distributed job the options or environment describe (``jax.distributed``, gloo
    collectives on the CPU); call it before any other JAX use. Returns None for one process.
    Calling it again with the same job is a no-op."""
    global _current
    dist = distributed_from(args)
    if dist is None:
        return None
    if _current is not None:
        if dataclasses.replace(_current, timeout=dist.timeout) != dist:
            raise RuntimeError(f"distributed: already initialized as {_current}, now asked for {dist}")
        _current = dist
        return dist
    import jax

    with contextlib.suppress(AttributeError, ValueError):     # CPU collectives across processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with contextlib.suppress(AttributeError, ValueError):     # its SIGTERM handler would keep workers alive
        jax.config.update("jax_enable_preemption_service", False)
    logger.info("joining the distributed job at %s as process %d of %d", dist.coordinator, dist.process_id,
                dist.num_processes)
    extra = {}
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        extra["heartbeat_timeout_seconds"] = max(100, int(2 * dist.timeout))   # our watchdog reports first
    jax.distributed.initialize(coordinator_address=dist.coordinator, num_processes=dist.num_processes,
                               process_id=dist.process_id, initialization_timeout=INITIALIZATION_TIMEOUT_S,
                               **extra)
    _current = dist
    _watch_compilations()
    return dist


def current() -> Distributed | None:
    """The distributed job this process joined (None: one process)."""
    return _current


def engine_args_for_job(args):
    """The options as the job runs them: the model split over all the job's devices, every
    step bucket compiled at start-up, before the first step (a compilation on first use would
    run under the step timeout, and hold every other process waiting; one in the background
    would leave the processes holding different buckets), and no host swap pool (swapping
    would need every process to move its own shards of the blocks: preemption recomputes)."""
    import jax

    n = jax.device_count()
    if args.tensor_parallel_size not in (1, n):
        raise ValueError(f"tensor_parallel_size: across {jax.process_count()} processes the model is split over "
                         f"all {n} devices (give {n}, or leave it at 1), got {args.tensor_parallel_size}")
    if not args.warm_up:
        logger.info("across processes every step bucket is compiled at start-up (--no-warm-up ignored)")
    if args.swap_space:
        logger.info("KV swap to host memory is off across processes: preempted sequences are recomputed")
    return dataclasses.replace(args, tensor_parallel_size=n, warm_up=True, compile_mode="eager", swap_space=0)


def check_same_kernels(model) -> None:
    """RuntimeError on every process unless all chose the same attention kernels and KV writes
    (the start-up kernel check runs in each on its own; different kernels mean different steps)."""
    import zlib

    from jax.experimental import multihost_utils

    from jaxengine.models.layers import attention_modules, kernel_name

    names = ",".join(f"{kernel_name(a.attention_fn)}/{kernel_name(a.kv_write_fn)}" for a in attention_modules(model))
    digest = np.array([zlib.crc32(names.encode())], np.uint32)
    everyone = multihost_utils.process_allgather(digest)
    if len(set(everyone.ravel().tolist())) > 1:
        raise RuntimeError(f"attention kernels: the processes chose different kernels at start-up (this one: "
                           f"{names}); run them with --skip-kernel-check or the same --attention-backend")


# ---------------------------------------------------------------- compilations (for checks)
_compilations = 0


def _watch_compilations() -> None:
    import jax

    def listener(event: str, duration: float, **_) -> None:
        global _compilations
        if event == "/jax/core/compile/backend_compile_duration":
            _compilations += 1

    jax.monitoring.register_event_duration_secs_listener(listener)


def num_compilations() -> int:
    """XLA compilations in this process since it joined the job."""
    return _compilations


# ---------------------------------------------------------------- failure
def fatal(message: str) -> None:
    """Report a distributed failure and end the process now (no clean-up: a peer is gone)."""
    dist = _current
    where = f"process {dist.process_id} of {dist.num_processes}" if dist else "this process"
    text = f"jaxengine: distributed failure on {where}: {message}. Exiting with status {FATAL_EXIT_STATUS}."
    with contextlib.suppress(Exception):
        if logger.hasHandlers():
            logger.critical(text)
            for handler in logging.getLogger().handlers:
                handler.flush()
        else:
            print(text, file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT_STATUS)
