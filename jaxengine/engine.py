"""The engine: ``step()`` = schedule -> dispatch -> (host work while the device runs) -> update."""
from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from jaxengine.config import EngineConfig
from jaxengine.core.scheduler import Scheduler
from jaxengine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepLimits
from jaxengine.lora_request import LoRARequest
from jaxengine.request import LatencyTargets, Request, RequestStatus, Sequence
from jaxengine.sampling_params import SamplingParams
from jaxengine.core.structured_output import StructuredOutputManager
from jaxengine.trace import StepTrace, TraceWriter, round_seconds


def speculation_counts(out: SchedulerOutput, output: ModelRunnerOutput, gate) -> dict:
    """A step's draft tokens, those accepted, how many rows accepted a draft token at each
    position, and the gate's choice for the step (the StepTrace fields; empty without speculation)."""
    if gate is None:
        return {}
    if not out.draft_token_ids:
        return {"speculative_k": gate.last_k, "speculation_gain": gate.last_gain}
    per_position = [0] * max(map(len, out.draft_token_ids.values()))
    for seq_id, tokens in zip(out.seq_ids, output.sampled_token_ids):
        if seq_id in out.draft_token_ids:
            for j in range(len(tokens) - 1):
                per_position[j] += 1
    return {"num_drafts": len(out.draft_token_ids), "num_draft_tokens": out.num_draft_tokens,
            "num_accepted_tokens": sum(per_position), "speculative_k": gate.last_k,
            "speculation_gain": gate.last_gain,
            "accepted_per_position": tuple(per_position)}


def plan_fields(plan, predicted_step_s: float, planner) -> dict:
    """A planned step's StepTrace fields: the planner's choices, its prediction of the step as it
    ran, its cost correction and a new request's predicted wait for its first token."""
    limits, knobs = plan.limits, plan.knobs
    return {"autopilot_budget": limits.max_num_batched_tokens, "autopilot_max_num_seqs": knobs.max_num_seqs_admitted,
            "autopilot_prefill_chunk": knobs.long_prefill_token_threshold or 0,
            "autopilot_partial_prefills": knobs.max_num_partial_prefills or 0,
            "predicted_step_s": round_seconds(predicted_step_s), "cost_correction": round(planner.cost.correction, 4),
            "predicted_queue_s": round_seconds(min(planner.outlook.ttft_s(0), 1e6))}


class Runner(Protocol):
    """What the engine asks of a model runner. ``execute`` is all a runner must have; the rest
    is optional (the fake runners have none of it), looked up when used (a test may wrap it):

    - ``dispatch(out) -> handle``: launch the step without waiting; ``handle.result()`` waits
      for its ``ModelRunnerOutput`` (async scheduling needs it).
    - ``abandon_uncollected()``: after a failed step, forget the launched steps not collected.
    - ``idle_s`` / ``device_wait_s``: seconds the device sat idle before launches / the host
      blocked on the device's results, for the step traces.
    - ``step_limits() -> StepLimits``: the most tokens and rows the next step may hold (less than
      configured while larger buckets still compile).
    """

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class _Done:
    """A step computed synchronously (runners without ``dispatch``)."""

    def __init__(self, result: ModelRunnerOutput) -> None:
        self._result = result

    def result(self) -> ModelRunnerOutput:
        return self._result


class StepPlanner(Protocol):
    """What the engine asks of a planner of its steps (``jaxengine.autopilot.Autopilot``)."""

    def plan(self, scheduler: Scheduler, limits: StepLimits | None):
        """-> the step's plan: its ``limits`` (within the runner's ``limits``), ``knobs`` and traced choices."""

    def observe(self, out: SchedulerOutput, step_s: float, finished: list[Request]) -> float:
        """The step ``out`` took ``step_s``; -> the time it was predicted to take."""

    def retry_after(self, num_prompt_tokens: int, slo: LatencyTargets | None) -> int | None:
        """Seconds after which to retry a new request that overload turns away; None: take it."""

    def taken(self, num_prompt_tokens: int) -> None:
        """A request taken by ``retry_after`` reached the engine."""


class _Launch(NamedTuple):
    """A step launched on the runner."""

    out: SchedulerOutput
    pending: object                 # ``result()`` waits for the step's tokens
    device_idle_s: float            # the runner's measure of device idle just before this launch
    plan: object = None             # the planner's plan for it (None without a planner)


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
    that serve penalties (which read the host's token history) wait for their results.

    Each step leaves a ``StepTrace`` in ``last_trace`` (and in ``traces`` with ``trace=True``);
    with ``trace_file`` each is appended to that JSONL file too, written while the device
    computes the next step."""

    def __init__(self, config: EngineConfig, runner: Runner, *, eos_token_id: int | None = None,
                 clock: Callable[[], float] = time.monotonic, trace: bool = False,
                 async_scheduling: bool = False, trace_file: str | Path | None = None,
                 grammar_compiler=None, timer: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.timer = timer                            # step times in traces (a simulator passes its clock)
        self.structured = StructuredOutputManager(grammar_compiler)     # None: structured output refused
        self.runner = runner
        self.eos_token_id = eos_token_id
        self.scheduler = Scheduler(config.scheduler, config.cache, clock=clock, speculative=config.speculative,
                                   token_buckets=getattr(runner, "token_buckets", None),
                                   max_loras=0 if config.lora is None else config.lora.max_loras)
        self.clock = clock
        self.async_scheduling = async_scheduling
        self.num_steps = 0
        self.num_run_ahead = 0          # steps launched before the previous step's results
        self.traces: list[StepTrace] | None = [] if trace else None
        self.last_trace: StepTrace | None = None      # the latest step's record (metrics read it)
        self.last_output: SchedulerOutput | None = None   # the latest schedule() (tests read it)
        self.trace_writer = None if trace_file is None else TraceWriter(trace_file)
        self.planner: StepPlanner | None = None       # chooses each step's limits (the autopilot)
        self._unwritten: StepTrace | None = None      # the latest record, until the next launch writes it
        self._started = timer()           # trace times count from here
        self._cycle_start = self._started             # this step's launch()
        self._wait_at_start = 0.0                     # the runner's device wait then
        self._in_flight: _Launch | None = None        # launched ahead
        self._launched: _Launch | None = None         # launched, not completed
        self._unapplied: list[SchedulerOutput] = []   # scheduled, results not yet applied

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    stop_check=None, slo: LatencyTargets | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Queue a request (``stop_check``: a beam search's stop strings, see ``Request``; ``slo``:
        its own latency targets for the autopilot; ``lora_request``: the adapter it runs with, read
        now: a bad one is a ValueError naming the file and field, and nothing is queued)."""
        request = Request(request_id, prompt_token_ids, sampling_params or SamplingParams(),
                          arrival_time=self.clock() if arrival_time is None else arrival_time,
                          priority=priority, eos_token_id=self.eos_token_id, cache_salt=cache_salt,
                          stop_check=stop_check, slo=slo, lora_request=lora_request,
                          lora_adapter=self.read_adapter(lora_request))
        if self.planner is not None:
            self.planner.taken(len(prompt_token_ids))
        if request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
            self.scheduler.add_request(request)
            return request
        if self.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.structured.submit(request)                # the scheduler takes it once its grammar is ready
        return request

    def read_adapter(self, lora_request: LoRARequest | None):
        """A request's adapter as the runner reads it (or finds it in host memory): its weights,
        which the request keeps, and its content ``digest``."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        slots = getattr(self.runner, "lora", None)
        if self.config.lora is None or slots is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it with enable_lora=True)")
        return slots.register(lora_request)

    def abort(self, request_id: str) -> bool:
        if (request := self.structured.awaiting.pop(request_id, None)) is not None:
            self.scheduler.add_request(request)          # finished through the scheduler, like any
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.structured.awaiting)

    def has_request(self, request_id: str) -> bool:
        """``request_id`` is unfinished here."""
        return request_id in self.scheduler.requests or request_id in self.structured.awaiting

    def finish_sequence(self, seq: Sequence, status: RequestStatus, stop_reason: int | str | None = None,
                        num_output_tokens: int | None = None) -> None:
        """Finish one running sequence from outside (a stop string found by output processing)."""
        self.scheduler.finish_sequence(seq, status, stop_reason, num_output_tokens)

    def running_requests(self) -> list[Request]:
        """The requests running now (a copy: finishing one does not change it)."""
        return list(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.structured.awaiting)

    @property
    def num_unfinished(self) -> int:
        """Requests not finished: waiting (for a grammar too), running or swapped out."""
        return len(self.scheduler.requests) + len(self.structured.awaiting)

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
        self._cycle_start, self._wait_at_start = self.timer(), self._device_wait_s()
        launched = self._in_flight or self._launch()
        self._in_flight = self._launch_ahead(launched.out)
        self._launched = launched
        self._write_trace()         # the previous step's record, while the device computes this one

    def complete(self) -> list[Request]:
        """The second half of ``step()``: wait for the launched step's results and apply them;
        returns the requests that finished."""
        launched, self._launched = self._launched, None
        output = launched.pending.result()
        finished = self.scheduler.update_from_output(launched.out, output)
        self._unapplied.remove(launched.out)
        self._record(launched, output, finished)
        if self.scheduler.gate is not None:
            self._observe_speculation(launched.out, output)
        return finished

    def _observe_speculation(self, out: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """The speculation gate learns this step's time and its drafts' outcome (``spec_decode.gate``)."""
        accepted = trials = 0
        for seq_id, tokens in zip(out.seq_ids, output.sampled_token_ids):
            draft = out.draft_token_ids.get(seq_id)
            if draft and tokens:
                accepted += len(tokens) - 1
                trials += len(tokens) - 1 + (len(tokens) - 1 < len(draft))    # a rejection is a trial too
        self.scheduler.gate.observe(out.total_num_scheduled_tokens, self.last_trace.step_s,
                                    out.num_prefill_tokens > 0, accepted, trials)

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
        self.flush_trace()

    def flush_trace(self) -> None:
        """Write every step's record to the trace file now (a no-op without one)."""
        if self.trace_writer is not None:
            self._write_trace()
            self.trace_writer.flush()

    def close(self) -> None:
        """Write what is left of the trace and close its file."""
        if self.trace_writer is not None:
            self.flush_trace()
            writer, self.trace_writer = self.trace_writer, None      # later steps are not traced
            writer.close()

    def abandon_failed_step(self) -> list[str]:
        """After ``step()`` raised: drop the steps scheduled but not applied (the one that failed
        and, with async scheduling, the one launched ahead of it), have the runner forget them, and
        return the ids of the requests they touched (ran, resumed or preempted). Their state is
        unknown, so the caller aborts them; the other requests are untouched. Raises when the
        engine cannot go on: the scheduler failed while building a step, or the runner's device
        state is lost."""
        s = self.scheduler
        if s.is_scheduling:                          # schedule() stopped half-way
            raise RuntimeError("the scheduler failed while building a step; its state is unknown")
        steps, self._unapplied, self._in_flight, self._launched = self._unapplied, [], None, None
        seq_ids = {seq_id for out in steps for seq_id in (*out.seq_ids, *out.preempted_seq_ids)}
        seq_ids.update(new.seq_id for out in steps for new in out.new_seqs)
        # The runner may never have seen these steps: tell it again which sequences to forget.
        s.resend_finished(seq_id for out in steps for seq_id in out.finished_seq_ids)
        if steps:       # their prompt blocks were cached when scheduled, and may never be computed
            s.kv.reset_prefix_cache()
        abandon = getattr(self.runner, "abandon_uncollected", None)      # optional (``Runner``)
        if abandon is not None:
            abandon()
        return [rid for rid, r in s.requests.items() if any(seq.seq_id in seq_ids for seq in r.seqs)]

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the scheduler (one whose constraint is invalid
        finishes there at once, ignored, with the compiler's message)."""
        for request, error in self.structured.take_ready(idle=not self.scheduler.has_unfinished_requests()):
            self.scheduler.add_request(request)
            if error is not None:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_IGNORED, error)

    def _launch(self) -> _Launch:
        """Schedule a step and launch it on the runner."""
        if self.structured.awaiting:
            self._admit_compiled()
        limits, knobs, plan = self._step_limits(), None, None
        if self.planner is not None:
            plan = self.planner.plan(self.scheduler, limits)
            limits, knobs = plan.limits, plan.knobs
        out = self.last_output = self.scheduler.schedule(limits, knobs)
        if self.scheduler.num_structured:
            self.structured.fill_bitmask(out)
        self._unapplied.append(out)
        idle = self._runner_counter("idle_s")
        dispatch = getattr(self.runner, "dispatch", None)     # optional (``Runner``)
        pending = dispatch(out) if dispatch else _Done(self.runner.execute(out))
        return _Launch(out, pending, self._runner_counter("idle_s") - idle, plan)

    def overload_retry_after(self, prompt_token_ids: list[int], slo: LatencyTargets | None = None) -> int | None:
        """The autopilot's overload policy for a new request of this prompt: seconds after which
        to retry when it would miss its time-to-first-token target by a margin; None: take it
        (always, without an autopilot)."""
        return None if self.planner is None else self.planner.retry_after(len(prompt_token_ids), slo)

    def _step_limits(self) -> StepLimits | None:
        """The runner's limits for the next step (it caps them while it still compiles); None for
        runners without (the configured limits)."""
        limits = getattr(self.runner, "step_limits", None)
        return limits() if limits is not None else None

    def _launch_ahead(self, out: SchedulerOutput) -> _Launch | None:
        """Async scheduling: the next step, launched before ``out``'s tokens are known (each of
        its sampling rows leaves a placeholder that the runner feeds from the device)."""
        if not (self.async_scheduling and self._can_run_ahead(out)):
            return None
        self.scheduler.add_placeholders(out)
        self.num_run_ahead += 1
        return self._launch()

    def _can_run_ahead(self, out: SchedulerOutput) -> bool:
        # Speculative decoding: the next step's drafts start from this step's accepted tokens,
        # which a step launched ahead cannot know (it would carry no draft).
        if not out.seq_ids or max(out.num_samples) > 1 or self.scheduler.gate is not None:
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

    def _record(self, launched: _Launch, output: ModelRunnerOutput, finished: list[Request]) -> None:
        step_s = self.timer() - self._cycle_start
        host_s = step_s - (self._device_wait_s() - self._wait_at_start)
        planned = {}
        if launched.plan is not None:
            predicted = self.planner.observe(launched.out, step_s, finished)
            planned = plan_fields(launched.plan, predicted, self.planner)
        self.last_trace = self._trace(launched, step_s, host_s, output, planned)
        if self.traces is not None:
            self.traces.append(self.last_trace)
        if self.trace_writer is not None:
            self._unwritten = self.last_trace
        self.num_steps += 1

    def _trace(self, launched: _Launch, step_s: float, host_s: float, output: ModelRunnerOutput,
               planned: dict) -> StepTrace:
        s, out = self.scheduler, launched.out
        return StepTrace(
            step=self.num_steps, time=round_seconds(self._cycle_start - self._started), num_rows=len(out.seq_ids),
            num_decode_tokens=out.num_decode_tokens, num_prefill_tokens=out.num_prefill_tokens,
            num_preemptions=out.num_preemptions, num_blocks_swapped_in=len(out.blocks_to_swap_in),
            num_blocks_swapped_out=len(out.blocks_to_swap_out), num_swap_fallbacks=out.num_swap_fallbacks,
            kv_usage=s.kv.usage, num_prefix_hit_tokens=out.num_prefix_hit_tokens, num_waiting=len(s.waiting),
            num_running=len(s.running), num_swapped=len(s.swapped), step_s=round_seconds(step_s),
            host_s=round_seconds(host_s), device_idle_s=round_seconds(launched.device_idle_s),
            max_context_len=max(map(operator.add, out.num_computed_tokens, out.num_scheduled_tokens), default=0),
            num_context_tokens=sum(out.num_computed_tokens) + sum(out.num_scheduled_tokens),
            expert_tokens=output.expert_tokens, **speculation_counts(out, output, s.gate), **planned)

    def _write_trace(self) -> None:
        if self._unwritten is not None:
            self.trace_writer.write(self._unwritten)
            self._unwritten = None

    def _device_wait_s(self) -> float:
        return self._runner_counter("device_wait_s")

    def _runner_counter(self, name: str) -> float:
        """One of the model runner's time counters; 0 for runners without it (the fake runners)."""
        return getattr(self.runner, name, 0.0)
