"""Process 0's steps, broadcast to the other processes of the job, and the watchdog that ends a
process whose peer is gone or hung.

As process 0 launches a step it sends the step's block moves and inputs to the others with
JAX's own multihost utilities (``multihost_utils.broadcast_one_to_all``: a collective over every
device, no sockets of ours), and they launch the same executable on them:

1. a header, ``int32[8]``: command (step, heartbeat, reset, stop), step number, the step's token
   and row buckets, which of its inputs are sent (a mask of 62 bits in two words; the others are
   the device-resident zeros each process already holds), the number of block-copy pairs, the
   payload's size in words;
2. for a step: the payload, the sent inputs and the copy pairs packed into one ``int32`` buffer
   whose size is rounded up to a power of two. Header and payload sizes are all broadcast once at
   start-up, so no broadcast compiles afterwards.

A step's inputs are a ``StepInputs`` pytree: the sent-inputs mask and the packing follow its
leaves' order, and a worker rebuilds the step from its treedef.

Broadcasts are serialised by a lock, and a step's launch stays inside it, so every process
dispatches the same collectives in the same order. When idle, process 0 broadcasts a heartbeat
(a header with nothing to do) every few seconds; a worker that hears nothing for
``distributed_timeout`` seconds knows process 0 is gone. A step, a broadcast or a wait that
takes longer than that, or a collective that fails (gloo raises when a peer's connection
closes), is a distributed failure (``multihost.fatal``). A step in flight when a peer dies may
block in gloo instead of failing: the watchdog ends it.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxengine.parallel.multihost import Distributed, fatal
from jaxengine.core.scheduler_output import NO_MOVES, BlockMoves

logger = logging.getLogger(__name__)

# Header commands.
HEARTBEAT, STEP, RESET, STOP = 0, 1, 2, 3
_HEADER_WORDS = 8
_MIN_PAYLOAD_WORDS = 256
_ALIGN = 8                            # bytes: each packed input starts at a multiple of it
_MASK_BITS = 31                       # bits of the sent-inputs mask in each of its two header words


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
        leaves = jax.tree_util.tree_leaves(self._template(t, b))
        if len(leaves) > 2 * _MASK_BITS:
            raise RuntimeError("a step has more inputs than the header's mask of sent inputs holds")
        largest = sum(_aligned(np.dtype(leaf.dtype).itemsize * int(np.prod(leaf.shape))) for leaf in leaves)
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
        if moves.state_copy or moves.state_swap_out or moves.state_swap_in:
            raise RuntimeError("recurrent state moves (a hybrid model's forks, swaps and prefix hits) are not sent "
                               "across processes yet")
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
        header = np.zeros(_HEADER_WORDS, np.int32)
        header[:2] = command, self.num_steps
        payload = None
        if command == STEP:
            arrays, sent = [], 0
            if inputs is not None:
                t, b = inputs.bucket
                for i, leaf in enumerate(jax.tree_util.tree_leaves(inputs)):
                    if isinstance(leaf, np.ndarray):   # else the device-resident zeros every process holds
                        sent |= 1 << i
                        arrays.append(leaf)
                header[2:5] = t, b, sent & (1 << _MASK_BITS) - 1
                header[7] = sent >> _MASK_BITS
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
        with self.watchdog.guard("waiting for process 0 (its next step or heartbeat)"):
            header = multihost_utils.broadcast_one_to_all(np.zeros(_HEADER_WORDS, np.int32))
        command, number, t, b, sent, num_copies, words, sent_high = (int(x) for x in header)
        sent |= sent_high << _MASK_BITS
        if command != STEP:
            return command, NO_MOVES, None
        self.num_steps = number
        with self.watchdog.guard(f"receiving step {number} from process 0"):
            payload = multihost_utils.broadcast_one_to_all(np.zeros(words, np.int32))
        leaves, treedef = jax.tree_util.tree_flatten(self._template(t, b)) if t else ([], None)
        specs = [(leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves) if sent >> i & 1]
        if num_copies:
            specs.append(((num_copies, 2), np.dtype(np.int32)))
        arrays = _unpack(payload, specs)
        moves = BlockMoves([], [], [tuple(pair) for pair in arrays.pop().tolist()]) if num_copies else NO_MOVES
        inputs = None
        if treedef is not None:      # the inputs not sent are the template's device-resident zeros
            received = iter(arrays)
            inputs = jax.tree_util.tree_unflatten(
                treedef, [next(received) if sent >> i & 1 else leaf for i, leaf in enumerate(leaves)])
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
