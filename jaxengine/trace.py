"""Step traces: ``StepTrace``, the one record of each engine step, and its JSONL file.

The Prometheus metrics, the live dashboard, the bench tool's plots and the replay simulator all
read these records, so their field names are a stable format: add fields, never rename one.
``TraceWriter`` appends them to a file, one JSON object per line (``dataclasses.asdict`` of the
record); ``read_trace`` reads them back, equal field by field.
"""
from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FLUSH_EVERY = 256           # records held before they are written
FLUSH_INTERVAL_S = 1.0      # ... or seconds since the last write, whichever comes first


@dataclass(frozen=True)
class StepTrace:
    """One engine step. Times are seconds, rounded to the microsecond, from a monotonic clock."""

    step: int                       # 0, 1, 2, ... (per engine)
    time: float                     # when the step's cycle began, since the engine started
    num_rows: int                   # sequences in the step
    num_decode_tokens: int
    num_prefill_tokens: int
    num_preemptions: int
    num_blocks_swapped_in: int
    num_blocks_swapped_out: int
    num_swap_fallbacks: int         # preemptions that recomputed because the host swap pool was full
    kv_usage: float                 # fraction of KV blocks in use after the step
    num_prefix_hit_tokens: int      # prompt tokens that requests admitted this step found in the prefix cache
    num_waiting: int
    num_running: int
    num_swapped: int
    step_s: float                   # wall time of the step's cycle, from launch() to the end of complete()
    host_s: float                   # of it, the time the host was not blocked on the device's results
    device_idle_s: float            # device idle before this step's launch (0: the runner does not measure it)
    # The step's shape as a cost model reads it (0 in records written before these fields existed).
    max_context_len: int = 0        # longest context a row attends to (tokens before it + its new ones)
    num_context_tokens: int = 0     # the rows' attended contexts summed
    # A mixture of experts: tokens routed to each expert this step, summed over the layers (empty
    # for a dense model): the experts' load balance.
    expert_tokens: tuple[int, ...] = ()
    # Speculative decoding: draft tokens the step verified, how many were accepted, and how many
    # rows accepted their draft token at each position (0 / empty without speculation).
    num_drafts: int = 0             # rows that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    # The speculation gate's choice for the step: the cap on every row's draft (0: off this step,
    # the drafts' buckets predicted to cost more than their accepted tokens buy) and the predicted
    # output tokens per second against speculation off (1.0 when off; 0 when nothing was proposed
    # or speculation is not configured).
    speculative_k: int = 0
    speculation_gain: float = 0.0
    # The autopilot's choices for the step (0 without it): its token budget, admission limit
    # (sequences), the most tokens one prompt got and how many prompts could be part-way through
    # at once (0: the configured values); its predicted time for the step as it ran (median,
    # before this step's time corrected the model), the correction of the cost profile then, and
    # a new request's predicted wait for its first token (queue and slot, without its own prompt).
    autopilot_budget: int = 0
    autopilot_max_num_seqs: int = 0
    autopilot_prefill_chunk: int = 0
    autopilot_partial_prefills: int = 0
    predicted_step_s: float = 0.0
    cost_correction: float = 0.0
    predicted_queue_s: float = 0.0


def round_seconds(seconds: float) -> float:
    """A time as records hold it: to the microsecond (shorter lines, no false precision)."""
    return round(seconds, 6)


_encode = json.JSONEncoder(separators=(",", ":")).encode     # built once: json.dumps(separators=) builds one per call


class TraceWriter:
    """Appends step records to a JSONL file. Lines are held in memory and written whole, every
    ``flush_every`` records or ``flush_interval_s`` seconds and on ``flush()``: a step costs one
    JSON encoding, and a reader following the file never meets half a line. Held lines are
    written when the writer is closed, collected or the interpreter exits. A failed write
    (a full disk) is logged and ends the tracing, not the engine's work."""

    def __init__(self, path: str | Path, *, flush_every: int = FLUSH_EVERY,
                 flush_interval_s: float = FLUSH_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self.num_records = 0
        self._file = open(self.path, "ab", buffering=0)
        self._lines: list[str] = []
        self._last_flush = clock()
        self._failed = False
        self._finalizer = weakref.finalize(self, _write_and_close, self._file, self._lines)

    def write(self, trace: StepTrace) -> None:
        if self._failed:
            return
        self._lines.append(_encode(vars(trace)) + "\n")     # vars(): asdict's dict, without its deep copy
        self.num_records += 1
        if len(self._lines) >= self.flush_every or self.clock() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = self.clock()
        if not self._lines or self._failed:
            return
        try:
            _write_lines(self._file, self._lines)
        except OSError:
            logger.exception("trace file %s: writing failed; no more steps are traced", self.path)
            self._failed = True
            self._lines.clear()

    def close(self) -> None:
        self.flush()
        self._finalizer()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_lines(file, lines: list[str]) -> None:
    data = memoryview("".join(lines).encode())
    lines.clear()
    while data:
        data = data[file.write(data):]


def _write_and_close(file, lines: list[str]) -> None:
    try:
        _write_lines(file, lines)
    finally:
        file.close()


def read_trace(path: str | Path) -> list[StepTrace]:
    """The records of a trace file. A last line without its newline is a write in progress
    (a file read while the engine runs) and is left out."""
    with open(path, encoding="utf-8") as f:
        return [_record(json.loads(line)) for line in f if line.endswith("\n")]


def _record(fields: dict) -> StepTrace:
    for name in ("expert_tokens", "accepted_per_position"):      # JSON has lists only
        if name in fields:
            fields[name] = tuple(fields[name])
    return StepTrace(**fields)


def replica_trace_file(path: str | Path, replica: int) -> Path:
    """Data-parallel replica ``replica``'s trace file: ``steps.jsonl`` -> ``steps.replica1.jsonl``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.replica{replica}{path.suffix}")
