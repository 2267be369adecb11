"""Start-up compilation of the step buckets: the order they are compiled in, and the thread that
compiles all but the smallest while the engine already serves.

The limits grow as a rectangle of (token bucket, row bucket) pairs, the token side and the row
side taking turns, and whenever the limits are (T, B) every pair a step within T tokens and B
rows pads to (``buckets.step_bucket``) is compiled: a step the scheduler builds within the
limits pads to a compiled bucket. The largest pair comes last.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

from jaxengine.core.scheduler_output import StepLimits
from jaxengine.buckets import reachable_pairs

logger = logging.getLogger(__name__)

COMPILE_MODES = ("background", "eager")
Pair = tuple[int, int]               # (token bucket, row bucket)

# One background compile at a time in the process (data-parallel replicas each have a compiler):
# they share the cores with the steps being served.
_ONE_AT_A_TIME = threading.Lock()
# While buckets compile in the background, the threads that compile run at this nice value. XLA
# compiles on threads of its own (a compile executor, a codegen pool, LLVM's workers), not only on
# the calling one; at equal priority they take most of the cores from the step being served. At 10
# the kernel's scheduler gives a runnable step about nine times their share, and the compiler the
# cores the step leaves idle.
COMPILE_NICENESS = 10
# While buckets compile, Python's GIL changes hands at least this often. The compiling thread holds
# it for long stretches (a bucket's tracing and lowering is Python), and a step takes it back many
# times (each launch, each result): at Python's default of 5 ms a turn, one-token steps measured
# 7x slower beside a thread running Python, at 0.5 ms 1.5x.
COMPILE_SWITCH_INTERVAL_S = 0.0005
# XLA's intra-op pool runs a step's thunks: it keeps its priority, as do the Python threads (the
# engine loop, the server's event loop, tokenizers).
STEP_THREAD_PREFIX = "tf_XLAEigen"


class _YieldingCores:
    """Counted across the process's background compilers: the first to start lowers the
    priority of every thread that does not serve steps and shortens the GIL's turns, the last to
    end restores both (a nice value an unprivileged process cannot lower again stays raised: it
    matters only where other processes compete for the cores)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._restore: dict[int, int] = {}
        self._switch_interval = sys.getswitchinterval()

    def __enter__(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._restore = _lower_priorities(_compiling_threads(threading.get_native_id()))
                self._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch_interval, COMPILE_SWITCH_INTERVAL_S))
            else:
                self._restore.update(_lower_priorities([threading.get_native_id()]))

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for thread, niceness in self._restore.items():
                    _set_priority(thread, niceness)
                self._restore = {}
                sys.setswitchinterval(self._switch_interval)


def _compiling_threads(compiler: int) -> list[int]:
    """The calling compiler thread and every native thread of the process that is neither a
    Python thread nor in XLA's intra-op pool (Linux; elsewhere just the caller)."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [compiler]
    python_threads = {t.native_id for t in threading.enumerate()} - {compiler}
    return [t for t in threads if t not in python_threads and not _name(t).startswith(STEP_THREAD_PREFIX)]


def _name(thread: int) -> str:
    try:
        with open(f"/proc/self/task/{thread}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _lower_priorities(threads: list[int]) -> dict[int, int]:
    """Nice each thread to at least COMPILE_NICENESS -> {thread: its nice value before}."""
    before = {}
    for thread in threads:
        try:
            before[thread] = os.getpriority(os.PRIO_PROCESS, thread)
        except (AttributeError, OSError):  # gone, or not a platform with per-thread priorities
            continue
        _set_priority(thread, max(COMPILE_NICENESS, before[thread]))
    return before


def _set_priority(thread: int, niceness: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, thread, niceness)
    except (AttributeError, OSError):      # gone, or not permitted: it keeps its priority
        pass


_YIELDING_CORES = _YieldingCores()


class CompileStage(NamedTuple):
    """Pairs to compile, and the pair whose limits (``limits_of``) hold once they are compiled
    (with all earlier stages)."""

    pairs: list[Pair]
    largest: Pair


def compile_stages(token_buckets: list[int], row_buckets: list[int]) -> list[CompileStage]:
    """Every pair a step can pad to (``reachable_pairs``), in stages. The largest pair grows
    from the smallest buckets, alternately by the next token bucket and the next row bucket (a
    side that has reached its largest bucket lets the other go on); each stage compiles the
    pairs the steps within its limits reach that no earlier stage compiled (possibly none)."""
    stages, compiled = [], set()
    for largest in _growth(token_buckets, row_buckets):
        pairs = [p for p in reachable_pairs(token_buckets, row_buckets, *limits_of(largest)) if p not in compiled]
        compiled.update(pairs)
        stages.append(CompileStage(pairs, largest))
    return stages


def step_pairs(token_buckets: list[int], row_buckets: list[int]) -> list[Pair]:
    """Every pair a step within the configured limits pads to: what start-up compiles."""
    return reachable_pairs(token_buckets, row_buckets, *limits_of((token_buckets[-1], row_buckets[-1])))


def _growth(token_buckets: list[int], row_buckets: list[int]) -> list[Pair]:
    i = j = 0
    largest = [(token_buckets[0], row_buckets[0])]
    grow_tokens = True
    while i < len(token_buckets) - 1 or j < len(row_buckets) - 1:
        if j == len(row_buckets) - 1 or (grow_tokens and i < len(token_buckets) - 1):
            i += 1
        else:
            j += 1
        grow_tokens = not grow_tokens
        largest.append((token_buckets[i], row_buckets[j]))
    return largest


def limits_of(largest: Pair) -> StepLimits:
    """A step's limits when ``largest`` is the largest compiled pair. The rows are capped by the
    tokens too: every running sequence decodes a token each step whatever the budget, so the
    sequences admitted must fit the token bucket."""
    tokens, rows = largest
    return StepLimits(tokens, min(rows, tokens))


class BackgroundCompiler:
    """Compiles ``stages`` in order on a daemon thread: ``compile_pair`` for each pair (it
    publishes the executable once compiled), then ``publish`` with the stage's limits.
    ``before_compile(pair)``, if given, runs on the thread before each compile (tests pause or
    slow it there). ``close`` stops after the compile in progress; at interpreter exit every
    compiler still running is closed, so none compiles while the interpreter goes down."""

    def __init__(self, stages: list[CompileStage], compile_pair: Callable[[Pair], None],
                 publish: Callable[[StepLimits], None], *, before_compile: Callable[[Pair], None] | None = None,
                 on_done: Callable[[float], None] | None = None) -> None:
        self.stages = stages
        self.compile_pair, self.publish = compile_pair, publish
        self.before_compile, self.on_done = before_compile, on_done
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._num_stages_done = 0
        self._thread = threading.Thread(target=self._run, name="jaxengine-compile", daemon=True)

    def start(self) -> None:
        _close_at_exit(self)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with _YIELDING_CORES:
                finished = self._compile_stages()
            if finished and self.on_done is not None:
                self.on_done(time.perf_counter() - start)
        except BaseException as error:     # noqa: BLE001 - reported by wait(); the compiled buckets serve on
            self.error = error
            logger.exception("background compilation failed; steps stay within the buckets compiled so far")
        finally:
            self._advance(final=True)

    def _compile_stages(self) -> bool:
        """True once every stage is compiled, False if closed first."""
        for stage in self.stages:
            for pair in stage.pairs:
                if self.before_compile is not None:
                    self.before_compile(pair)
                if self._stop.is_set():
                    return False
                with _ONE_AT_A_TIME:
                    self.compile_pair(pair)
            self.publish(limits_of(stage.largest))
            self._advance()
        return True

    def _advance(self, final: bool = False) -> None:
        with self._progress:
            if not final:
                self._num_stages_done += 1
            self._progress.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread: True once every stage is compiled, False when ``timeout`` seconds
        passed first or it was closed before the end. Raises what the thread raised, if it failed."""
        self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError(f"background compilation failed: {self.error}") from self.error
        return self._num_stages_done == len(self.stages)

    def wait_for_stage(self, timeout: float) -> None:
        """Wait until the next stage is published, the thread ends, or ``timeout`` passes."""
        with self._progress:
            seen = self._num_stages_done
            self._progress.wait_for(lambda: self._num_stages_done != seen or not self._thread.is_alive(),
                                    timeout)

    def close(self) -> None:
        """Stop after the compile in progress (or the ``before_compile`` call), and wait for it."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        _running.discard(self)


_running: weakref.WeakSet[BackgroundCompiler] = weakref.WeakSet()
_exit_hook_registered = False


def _close_at_exit(compiler: BackgroundCompiler) -> None:
    """Close ``compiler`` at interpreter exit if it still runs. The hook is registered with the
    first compiler, after JAX's own exit hooks (registered as its backends start), so it runs
    before them: exit hooks run last registered first."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_close_running)
        _exit_hook_registered = True
    _running.add(compiler)


def _close_running() -> None:
    for compiler in list(_running):
        compiler.close()
