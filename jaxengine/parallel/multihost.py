"""One engine over several processes (hosts): ``jax.distributed``, process 0's steps sent to the
others, and a watchdog that stops a process whose peer is gone or hung.

Every process holds a share of the model and of the KV cache (tensor parallelism over all the
job's devices) and runs the same compiled steps. Process 0 alone schedules, tokenizes and serves;
as it launches a step it sends the step's block moves and inputs to the others with JAX's own
multihost utilities (``multihost_utils.broadcast_one_to_all``: a collective over every device,
no sockets of ours), and they launch the same executable on them:

1. a header, ``int32[8]``: command (step, heartbeat, reset, stop), step number, the step's token
   and row buckets, which of its inputs are sent (the others are the device-resident zeros each
   process already holds), the number of block-copy pairs, the payload's size in words;
2. for a step: the payload, the sent inputs and the copy pairs packed into one ``int32`` buffer
   whose size is rounded up to a power of two. Header and payload sizes are all broadcast once at
   start-up, so no broadcast compiles afterwards.

Broadcasts are serialised by a lock, and a step's launch stays inside it, so every process
dispatches the same collectives in the same order. When idle, process 0 broadcasts a heartbeat
(a header with nothing to do) every few seconds; a worker that hears nothing for
``distributed_timeout`` seconds knows process 0 is gone. A step, a broadcast or a wait that
takes longer than that, or a collective that fails (gloo raises when a peer's connection
closes), ends the process with a message naming what failed and status ``FATAL_EXIT_STATUS``
(``os._exit``: a collective blocked in C++ cannot be interrupted, and JAX's shutdown barrier
would wait for the dead peer). When process 0 itself dies, the others stop at once: their
broadcast fails, or JAX's distributed runtime (whose coordinator lives in process 0) ends them
("Terminating process because the JAX distributed service detected fatal errors"), whichever
comes first. A step in flight when a peer dies may block in gloo instead of failing: the
watchdog ends it.

Swapping KV blocks to host memory is off across processes (each would have to move its own
shards): preemption recomputes.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXENGINE_COORDINATOR"
ENV_NUM_PROCESSES = "JAXENGINE_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXENGINE_PROCESS_ID"
FATAL_EXIT_STATUS = 3
INITIALIZATION_TIMEOUT_S = 300        # all processes must have connected by then

# Header commands.
HEARTBEAT, STEP, RESET, STOP = 0, 1, 2, 3
_HEADER_WORDS = 8
_MIN_PAYLOAD_WORDS = 256
_ALIGN = 8                            # bytes: each packed input starts at a multiple of it


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
    """The options as the job runs them: the model split over all the job's devices, and every
    step bucket compiled at start-up, before the first step (a compilation on first use would run
    under the step timeout, and hold every other process waiting; one in the background would
    leave the processes holding different buckets)."""
    import jax

    n = jax.device_count()
    if args.tensor_parallel_size not in (1, n):
        raise ValueError(f"tensor_parallel_size: across {jax.process_count()} processes the model is split over "
                         f"all {n} devices (give {n}, or leave it at 1), got {args.tensor_parallel_size}")
    if not args.warm_up:
        logger.info("across processes every step bucket is compiled at start-up (--no-warm-up ignored)")
    return dataclasses.replace(args, tensor_parallel_size=n, warm_up=True, compile_mode="eager")


def without_swap(config):
    """The engine configuration with no host swap pool (swapping would need every process to move
    its own shards of the blocks): preemption recomputes."""
    if config.cache.num_cpu_blocks:
        logger.info("KV swap to host memory is off across processes: preempted sequences are recomputed")
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_cpu_blocks=0))


def check_same_kernels(model) -> None:
    """RuntimeError on every process unless all chose the same attention kernels and KV writes
    (the start-up kernel check runs in each on its own; different kernels mean different steps)."""
    import zlib

    from jax.experimental import multihost_utils

    from jaxengine.runner.kernel_check import _name, attention_modules

    names = ",".join(f"{_name(a.attention_fn)}/{_name(a.kv_write_fn)}" for a in attention_modules(model))
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


class Watchdog:
    """Ends the process (``fatal``) when a guarded section runs past its timeout."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, str]] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._watch, name="jaxengine-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str):
        """Within this block, ``what`` must be done within the timeout; an exception raised in
        it is a distributed failure too (a collective failed: the peers' state is unknown)."""
        with self._lock:
            token = next(self._ids)
            self._armed[token] = (time.monotonic() + self.timeout, what)
        try:
            yield
        except Exception as error:     # noqa: BLE001 - any failure of a collective is fatal
            fatal(f"{what} failed: {type(error).__name__}: {error}; another process of the job is gone or broken")
        finally:
            with self._lock:
                self._armed.pop(token, None)

    def _watch(self) -> None:
        period = min(0.5, self.timeout / 10)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                late = [what for deadline, what in self._armed.values() if now > deadline]
            if late:
                fatal(f"{late[0]} took longer than {self.timeout:g} s (--distributed-timeout); another process "
                      f"of the job is gone or hung")


# ---------------------------------------------------------------- the step channel
class StepChannel:
    """Process 0's steps, broadcast to the other processes. Process 0 uses ``sending`` (around
    each launch), ``waiting`` (around each result read), ``reset`` and ``stop``, and a heartbeat
    thread; the others ``receive``. Both sides call ``warm_up`` first, with the same runner."""

    def __init__(self, runner, dist: Distributed) -> None:
        self.runner, self.dist = runner, dist
        self.is_source = dist.process_id == 0
        self.watchdog = Watchdog(dist.timeout)
        self.heartbeat_interval = max(0.2, min(5.0, dist.timeout / 5))
        self.num_steps = 0
        self._lock = threading.RLock()
        self._last_send = time.monotonic()
        self._stopped = False
        self._templates: dict[tuple[int, int], object] = {}
        # Payload sizes in words: powers of two up to the largest step (every input sent) with the
        # most block copies a step can emit.
        t, b = runner.token_buckets[-1], runner.request_buckets[-1]
        if len(_leaves(self._template(t, b))) > 31:
            raise RuntimeError("a step has more inputs than the header's mask of sent inputs holds")
        largest = sum(_aligned(np.dtype(leaf.dtype).itemsize * int(np.prod(leaf.shape)))
                      for _, leaf in _leaves(self._template(t, b)))
        largest += _aligned(8 * runner.mover.max_copies)
        self.payload_buckets = [_MIN_PAYLOAD_WORDS]
        while self.payload_buckets[-1] * 4 < largest:
            self.payload_buckets.append(self.payload_buckets[-1] * 2)

    def _template(self, t: int, b: int):
        """All-padding inputs of a bucket: the shapes a worker unpacks into, and its device zeros."""
        template = self._templates.get((t, b))
        if template is None:
            template = self._templates[(t, b)] = self.runner.batch.padded(t, b)
        return template

    # ---- start-up ----
    def warm_up(self) -> None:
        """Broadcast the header and every payload size once (compiling their collectives, and
        waiting for every process to be ready); then, on process 0, start the heartbeats."""
        import jax
        from jax.experimental import multihost_utils

        for t, b in self.runner.bucket_pairs():    # a worker's templates, built before the first step
            self._template(t, b)
        # Not timed: the processes may take different times to load and compile.
        try:
            multihost_utils.broadcast_one_to_all(np.zeros(_HEADER_WORDS, np.int32))
            for words in self.payload_buckets:
                multihost_utils.broadcast_one_to_all(np.zeros(words, np.int32))
        except Exception as error:      # noqa: BLE001 - a peer is gone
            fatal(f"the start-up broadcasts failed: {type(error).__name__}: {error}")
        self._last_send = time.monotonic()
        logger.info("process %d of %d ready (%d devices of %d)", self.dist.process_id, self.dist.num_processes,
                    jax.local_device_count(), jax.device_count())
        if self.is_source:
            threading.Thread(target=self._heartbeats, name="jaxengine-heartbeat", daemon=True).start()
            atexit.register(self.stop)

    # ---- process 0 ----
    @contextlib.contextmanager
    def sending(self, moves, inputs):
        """Around a launch on process 0: broadcast its moves and inputs first; the launch stays
        under the lock, so every process dispatches collectives in the same order."""
        if moves.swap_out or moves.swap_in:
            raise RuntimeError("KV swap is off across processes (num_cpu_blocks must be 0)")
        with self._lock:
            if self._stopped:
                raise RuntimeError("the distributed job was stopped")
            self.num_steps += 1
            what = f"sending step {self.num_steps} to the other processes"
            with self.watchdog.guard(what):
                self._send(STEP, moves.copy, inputs)
            with self.watchdog.guard(f"launching step {self.num_steps}"):
                yield

    @contextlib.contextmanager
    def waiting(self, what: str):
        with self.watchdog.guard(f"{what} (step {self.num_steps})"):
            yield

    def reset(self) -> None:
        """Have the other processes forget the last step's tokens (after a failed step)."""
        with self._lock, self.watchdog.guard("sending a reset to the other processes"):
            if not self._stopped:
                self._send(RESET)

    def stop(self) -> None:
        """Tell the other processes to leave their loops (at exit); later steps are refused."""
        with self._lock:
            if self._stopped:
                return
            with self.watchdog.guard("sending stop to the other processes"):
                self._send(STOP)
            self._stopped = True
        logger.info("sent stop to the other processes after %d steps", self.num_steps)

    def _heartbeats(self) -> None:
        period = self.heartbeat_interval / 4
        while not self._stopped:
            time.sleep(period)
            if time.monotonic() - self._last_send < self.heartbeat_interval:
                continue
            with self._lock:
                if self._stopped or time.monotonic() - self._last_send < self.heartbeat_interval:
                    continue
                with self.watchdog.guard("sending a heartbeat to the other processes"):
                    self._send(HEARTBEAT)

    def _send(self, command: int, copies=(), inputs=None) -> None:
        from jax.experimental import multihost_utils

        header = np.zeros(_HEADER_WORDS, np.int32)
        header[:2] = command, self.num_steps
        payload = None
        if command == STEP:
            arrays, sent = [], 0
            if inputs is not None:
                t, b = inputs.bucket
                for i, (_, leaf) in enumerate(_leaves(inputs)):
                    if isinstance(leaf, np.ndarray):   # else the device-resident zeros every process holds
                        sent |= 1 << i
                        arrays.append(leaf)
                header[2:5] = t, b, sent
            if copies:
                arrays.append(np.asarray(copies, np.int32).reshape(-1, 2))
            payload = _pack(arrays, self.payload_buckets)
            header[5:7] = len(copies), len(payload)
        multihost_utils.broadcast_one_to_all(header)
        if payload is not None:
            multihost_utils.broadcast_one_to_all(payload)
        self._last_send = time.monotonic()

    # ---- the other processes ----
    def receive(self):
        """The next command from process 0: (command, moves, inputs or None)."""
        from jax.experimental import multihost_utils

        from jaxengine.core.scheduler_output import NO_MOVES, BlockMoves

        with self.watchdog.guard("waiting for process 0 (its next step or heartbeat)"):
            header = multihost_utils.broadcast_one_to_all(np.zeros(_HEADER_WORDS, np.int32))
        command, number, t, b, sent, num_copies, words = (int(x) for x in header[:7])
        if command != STEP:
            return command, NO_MOVES, None
        self.num_steps = number
        with self.watchdog.guard(f"receiving step {number} from process 0"):
            payload = multihost_utils.broadcast_one_to_all(np.zeros(words, np.int32))
        template = self._template(t, b) if t else None
        specs = [] if template is None else \
            [(leaf.shape, leaf.dtype) for i, (_, leaf) in enumerate(_leaves(template)) if sent >> i & 1]
        if num_copies:
            specs.append(((num_copies, 2), np.dtype(np.int32)))
        arrays = _unpack(payload, specs)
        moves = BlockMoves([], [], [tuple(pair) for pair in arrays.pop().tolist()]) if num_copies else NO_MOVES
        inputs = None
        if template is not None:
            received = iter(arrays)
            inputs = _rebuild(template, [next(received) if sent >> i & 1 else leaf
                                         for i, (_, leaf) in enumerate(_leaves(template))])
        return command, moves, inputs


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _pack(arrays: list[np.ndarray], buckets: list[int]) -> np.ndarray:
    """Arrays -> one int32 buffer (each array at an aligned offset), padded to a size bucket."""
    total = sum(_aligned(a.nbytes) for a in arrays)
    words = next((w for w in buckets if 4 * w >= total), None)
    if words is None:
        raise RuntimeError(f"a step's inputs ({total} bytes) exceed the largest payload ({4 * buckets[-1]} bytes)")
    buffer = np.zeros(words, np.int32)
    raw = buffer.view(np.uint8)
    offset = 0
    for a in arrays:
        raw[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        offset += _aligned(a.nbytes)
    return buffer


def _unpack(buffer: np.ndarray, specs: list[tuple[tuple, np.dtype]]) -> list[np.ndarray]:
    raw = np.ascontiguousarray(buffer).view(np.uint8)
    arrays, offset = [], 0
    for shape, dtype in specs:
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * int(np.prod(shape))
        arrays.append(raw[offset:offset + nbytes].view(dtype).reshape(shape))
        offset += _aligned(nbytes)
    return arrays


def _leaves(inputs) -> list[tuple[str, object]]:
    """A step's inputs as (name, array) in a fixed order (``StepInputs`` less its host-side count)."""
    out = [("input_ids", inputs.input_ids), ("prev_index", inputs.prev_index)]
    out += [(f"attention.{f.name}", getattr(inputs.attention, f.name)) for f in dataclasses.fields(inputs.attention)]
    out.append(("logits_indices", inputs.logits_indices))
    out += [(f"sampling.{f.name}", getattr(inputs.sampling, f.name)) for f in dataclasses.fields(inputs.sampling)]
    out += [("prompt_lp_want", inputs.prompt_lp_want), ("prompt_lp_target", inputs.prompt_lp_target)]
    return out


def _rebuild(template, values: list) -> object:
    """``StepInputs`` like ``template`` with its leaves (in ``_leaves`` order) replaced by ``values``."""
    named = dict(zip((name for name, _ in _leaves(template)), values))
    nested = {"attention": {}, "sampling": {}}
    for name, value in named.items():
        if "." in name:
            group, field = name.split(".")
            nested[group][field] = value
    return dataclasses.replace(
        template, input_ids=named["input_ids"], prev_index=named["prev_index"],
        attention=dataclasses.replace(template.attention, **nested["attention"]),
        logits_indices=named["logits_indices"],
        sampling=dataclasses.replace(template.sampling, **nested["sampling"]),
        prompt_lp_want=named["prompt_lp_want"], prompt_lp_target=named["prompt_lp_target"])


# ---------------------------------------------------------------- the workers
class Worker:
    """A process other than 0: runs process 0's steps on its devices until told to stop."""

    def __init__(self, runner, channel: StepChannel) -> None:
        self.runner, self.channel = runner, channel

    def run(self) -> None:
        import jax

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
    (the process exits with ``FATAL_EXIT_STATUS``, or JAX's runtime ends it)."""
    dist = initialize(engine_args)
    if dist is None or not dist.is_worker:
        raise ValueError("run_worker: for processes other than 0 of a distributed job (--distributed-coordinator, "
                         "--num-processes, --process-id > 0); process 0 runs LLM or the server")
    from jaxengine.llm import LLM

    print(f"jaxengine: process {dist.process_id} of {dist.num_processes}: loading the model's share and "
          f"compiling...", flush=True)
    llm = LLM.for_worker(engine_args, progress=progress)
    print(f"jaxengine: process {dist.process_id} of {dist.num_processes}: running process 0's steps "
          f"(stops with an error if it is silent for {dist.timeout:g} s)", flush=True)
    Worker(llm.runner, llm.channel).run()
    print(f"jaxengine: process {dist.process_id}: stopped by process 0", flush=True)
    return 0
