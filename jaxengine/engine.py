"""The engine: ``step()`` = schedule -> dispatch -> (host work while the device runs) -> update."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from jaxengine.config import EngineConfig
from jaxengine.core.scheduler import Scheduler
from jaxengine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxengine.request import Request, RequestStatus, Sequence
from jaxengine.sampling_params import SamplingParams


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class _Done:
    """A step computed synchronously (runners without ``dispatch``)."""

    def __init__(self, result: ModelRunnerOutput) -> None:
        self._result = result

    def result(self) -> ModelRunnerOutput:
        return self._result


@dataclass(frozen=True)
class StepTrace:
    """One compact record per step, for metrics and dashboards."""

    step: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_preemptions: int
    num_blocks_swapped_in: int
    num_blocks_swapped_out: int
    kv_usage: float
    num_waiting: int
    num_running: int
    num_swapped: int
    num_swap_fallbacks: int    # preemptions that recomputed because the host swap pool was full


@dataclass(frozen=True)
class EngineStats:
    """The engine's state now (gauges) and its prefix-cache counters since start."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    prefix_cache_queries: int       # prompt tokens looked up
    prefix_cache_hits: int          # of those, tokens served from the cache


class Engine:
    """``async_scheduling``: while the device computes step n, the host schedules and launches
    step n + 1 before it has step n's tokens (the scheduler gives each sampling row a placeholder
    and the runner feeds the decode its token from the device). A sequence that stops at step n
    then has one wasted row in step n + 1; outputs are the same. Steps that fork (n > 1) or
    that serve penalties (which read the host's token history) wait for their results."""

    def __init__(self, config: EngineConfig, runner: Runner, *, eos_token_id: int | None = None,
                 clock: Callable[[], float] = time.monotonic, trace: bool = False,
                 async_scheduling: bool = False) -> None:
        self.config = config
        self.runner = runner
        self.eos_token_id = eos_token_id
        self.scheduler = Scheduler(config.scheduler, config.cache, clock=clock)
        self.clock = clock
        self.async_scheduling = async_scheduling
        self.num_steps = 0
        self.num_run_ahead = 0          # steps launched before the previous step's results
        self.traces: list[StepTrace] | None = [] if trace else None
        self.last_trace: StepTrace | None = None      # the latest step's record (metrics read it)
        self.last_output: SchedulerOutput | None = None   # the latest schedule() (tests read it)
        self._in_flight: tuple[SchedulerOutput, object] | None = None     # launched ahead
        self._launched: tuple[SchedulerOutput, object] | None = None      # launched, not completed
        self._unapplied: list[SchedulerOutput] = []   # scheduled, results not yet applied

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        request = Request(request_id, prompt_token_ids, sampling_params or SamplingParams(),
                          arrival_time=self.clock() if arrival_time is None else arrival_time,
                          priority=priority, eos_token_id=self.eos_token_id, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_request(self, request_id: str) -> bool:
        """``request_id`` is unfinished here."""
        return request_id in self.scheduler.requests

    def finish_sequence(self, seq: Sequence, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish one running sequence from outside (a stop string found by output processing)."""
        self.scheduler.finish_sequence(seq, status, stop_reason)

    def running_requests(self) -> list[Request]:
        """The requests running now (a copy: finishing one does not change it)."""
        return list(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        """Requests not finished: waiting, running or swapped out."""
        return len(self.scheduler.requests)

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Leading blocks of this prompt in the prefix cache now (a query: nothing changes)."""
        return self.scheduler.kv.cached_prefix_blocks(token_ids, cache_salt)

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        return EngineStats(len(s.running), len(s.waiting), len(s.swapped), kv.usage, kv.prefix_cache_queries,
                           kv.prefix_cache_hits)

    def step(self, while_running: Callable[[], object] | None = None) -> list[Request]:
        """Run one step; returns the requests that finished (stopped, aborted or ignored).

        ``while_running`` is host work done while the device computes this step (output
        processing of the previous step: detokenising, stop strings, streaming). It may finish
        or abort requests; a row finished that way has its token discarded, so the outputs are
        the same as doing that work between steps."""
        self.launch()
        if while_running is not None:
            while_running()
        return self.complete()

    def launch(self) -> None:
        """The first half of ``step()``: schedule and launch a step (with async scheduling, take
        the one already launched and launch the next); the device computes while the caller works."""
        out, pending = self._in_flight or self._launch()
        self._in_flight = self._launch_ahead(out)
        self._launched = out, pending

    def complete(self) -> list[Request]:
        """The second half of ``step()``: wait for the launched step's results and apply them;
        returns the requests that finished."""
        out, pending = self._launched
        self._launched = None
        finished = self.scheduler.update_from_output(out, pending.result())
        self._unapplied.remove(out)
        self._record(out)
        return finished

    @property
    def is_launched(self) -> bool:
        """A step was launched and not yet completed."""
        return self._launched is not None

    def flush(self) -> None:
        """Collect the step in flight and run one empty step, which tells the runner about every
        sequence that finished (so it holds no state for them)."""
        while self._in_flight is not None:
            self.step()
        self.step()

    def abandon_failed_step(self) -> list[str]:
        """After ``step()`` raised: drop the steps scheduled but not applied (the one that failed
        and, with async scheduling, the one launched ahead of it), have the runner forget them, and
        return the ids of the requests they touched (ran, resumed or preempted). Their state is
        unknown, so the caller aborts them; the other requests are untouched. Raises when the
        engine cannot go on: the scheduler failed while building a step, or the runner's device
        state is lost."""
        s = self.scheduler
        if s._out is not None:                       # schedule() stopped half-way
            raise RuntimeError("the scheduler failed while building a step; its state is unknown")
        steps, self._unapplied, self._in_flight, self._launched = self._unapplied, [], None, None
        seq_ids = {seq_id for out in steps for seq_id in (*out.seq_ids, *out.preempted_seq_ids)}
        seq_ids.update(new.seq_id for out in steps for new in out.new_seqs)
        # The runner may never have seen these steps: tell it again which sequences to forget.
        s._finished_seq_ids.extend(seq_id for out in steps for seq_id in out.finished_seq_ids)
        abandon = getattr(self.runner, "abandon_uncollected", None)
        if abandon is not None:
            abandon()
        return [rid for rid, r in s.requests.items() if any(seq.seq_id in seq_ids for seq in r.seqs)]

    def _launch(self) -> tuple[SchedulerOutput, object]:
        """Schedule a step and launch it on the runner (a handle whose ``result()`` waits)."""
        out = self.last_output = self.scheduler.schedule()
        self._unapplied.append(out)
        dispatch = getattr(self.runner, "dispatch", None)
        return out, dispatch(out) if dispatch else _Done(self.runner.execute(out))

    def _launch_ahead(self, out: SchedulerOutput) -> tuple[SchedulerOutput, object] | None:
        """Async scheduling: the next step, launched before ``out``'s tokens are known (each of
        its sampling rows leaves a placeholder that the runner feeds from the device)."""
        if not (self.async_scheduling and self._can_run_ahead(out)):
            return None
        self.scheduler.add_placeholders(out)
        self.num_run_ahead += 1
        return self._launch()

    @staticmethod
    def _can_run_ahead(out: SchedulerOutput) -> bool:
        if not out.seq_ids or max(out.num_samples) > 1:
            return False
        return not any(seq.request.needs_history for seq in out.scheduled_seqs)

    def run(self, max_steps: int = 1_000_000) -> list[Request]:
        """Step until every request has finished; returns them in finishing order."""
        finished: list[Request] = []
        for _ in range(max_steps):
            if not self.has_unfinished_requests():
                return finished
            finished += self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    def _record(self, out: SchedulerOutput) -> None:
        self.last_trace = self._trace(out)
        if self.traces is not None:
            self.traces.append(self.last_trace)
        self.num_steps += 1

    def _trace(self, out: SchedulerOutput) -> StepTrace:
        s = self.scheduler
        return StepTrace(self.num_steps, out.num_decode_tokens, out.num_prefill_tokens, out.num_preemptions,
                         len(out.blocks_to_swap_in), len(out.blocks_to_swap_out), s.kv.usage,
                         len(s.waiting), len(s.running), len(s.swapped), out.num_swap_fallbacks)
