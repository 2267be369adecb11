"""The autopilot: each step's scheduling knobs, chosen to meet the latency targets.

No fixed ``max_num_batched_tokens``, delay factor or admission limit is best for every workload,
and traffic changes during the day. Before each step the autopilot looks at the scheduler's
queues, predicts step times from its cost model (``cost.OnlineCost``: a measured profile
corrected by the steps it sees) and hands the scheduler that step's ``StepLimits`` and
``StepKnobs``:

- **token budget**: the largest compiled token bucket whose step (the decodes running now plus
  prompt tokens for the rest) stays within the inter-token-latency target at its percentile, so
  prompts advance as fast as the decodes' latency allows; the whole configured budget when
  nothing decodes (then the budget only sets how fast prompts go) or nothing waits, or when the
  decodes alone miss the target (a smaller step cannot save it). The budget is never below the
  decodes plus one prompt token: running requests are never starved.
- **admission limit** (``StepKnobs.max_num_seqs_admitted``, ``max_num_seqs`` its ceiling): the
  most sequences whose decode step stays within the ITL target; never below those running, and
  no limit when one sequence alone misses the target. It gates admissions and swap-ins only:
  nobody is preempted for it (a priority policy's preemption judges by the step's limits).
- **prefill chunking** (``long_prefill_token_threshold``, ``max_num_partial_prefills``): when
  a long prompt heads the queue and others wait behind it, the prompt budget is shared 2 or 4
  ways if the long prompt still meets its own TTFT target so (or misses it either way), so short
  prompts behind it are not held up for its whole prefill.
- **delay factor**: the configured one, dropped for a step when holding prompts back would make
  the oldest waiting request miss its TTFT target.
- **overload**: ``Outlook`` predicts a new request's wait for its first token (the prompt tokens
  queued ahead at the chosen budget's prompt rate, or its wait for a sequence slot, whichever is
  longer); with the ``reject`` policy a request predicted to miss its target by more than
  ``OVERLOAD_MARGIN`` while others wait ahead of it is turned away (the server answers 503 with
  Retry-After) instead of making every request late. Running requests are never touched.

Speculative decoding's drafts take only the budget the step's other rows leave, and the budget
is priced with them (each decode's most draft tokens), so a verify step too stays within the ITL
target; the speculation gate still decides each row's draft length.

The budget is any token count up to ``max_num_batched_tokens``: the runner pads it to a bucket
compiled at start-up, so a choice never compiles. Steps run while the runner still compiles
buckets in the background are not learnt from (the compiler shares the cores). The plan reads the scheduler and writes
nothing to it: the scheduler applies the limits.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from jaxengine.autopilot.cost import OnlineCost
from jaxengine.config import AutopilotConfig, SchedulerConfig
from jaxengine.core.scheduler import Scheduler
from jaxengine.core.scheduler_output import SchedulerOutput, StepKnobs, StepLimits
from jaxengine.costmodel.step_shape import StepShape
from jaxengine.request import LatencyTargets, Request, RequestStatus

OVERLOAD_MARGIN = 1.25      # a new request is turned away when predicted to take this x its TTFT target
SHARES = (4, 2)             # ways the prompt budget may be shared between prompts part-way through
OUTPUT_LEN_DECAY = 0.9      # weight of earlier requests in the mean output length
MIN_RETRY_AFTER_S = 1


class Prefill(NamedTuple):
    """A request with prompt tokens still to compute, in the order the scheduler takes them."""

    remaining: int              # prompt tokens left (a prefix-cache hit is not foreseen)
    computed: int               # tokens already in its KV cache
    waited_s: float             # since it arrived
    ttft_s: float | None        # its target


@dataclass
class Load:
    """The scheduler's queues as the plan reads them."""

    decode_rows: int = 0
    decode_context_sum: int = 0
    decode_context_max: int = 0
    running_seqs: int = 0
    head_seqs: int = 1                                             # sequences the queue's head needs
    remaining_outputs: list[int] = field(default_factory=list)     # of the decoding sequences (max_tokens)
    prefills: list[Prefill] = field(default_factory=list)          # the first few, in order
    queued_tokens: int = 0                                         # prompt tokens of every prefill
    draft_tokens: int = 0                                          # the most the decodes could draft
    num_waiting: int = 0
    itl_s: float | None = None                                     # the tightest of the running requests'


class Outlook(NamedTuple):
    """What a new request would wait for its first token now (written by the engine thread each
    step, read by the server's threads as one value)."""

    queued_tokens: int = 0      # prompt tokens ahead of it
    num_waiting: int = 0        # requests ahead of it
    prefill_rate: float = math.inf      # prompt tokens per second at the chosen budget
    seat_wait_s: float = 0.0    # until a sequence slot frees for it
    step_s: float = 0.0         # a step's time now

    def ttft_s(self, num_prompt_tokens: int) -> float:
        return max((self.queued_tokens + num_prompt_tokens) / self.prefill_rate, self.seat_wait_s) + self.step_s


class StepPlan(NamedTuple):
    """One step's choices (the ``StepTrace`` fields ``autopilot_*``)."""

    limits: StepLimits
    knobs: StepKnobs
    planned_step_s: float       # predicted time of the planned step (median)


class Autopilot:
    """Plans each step's ``StepLimits`` (``plan``) and learns from each step's time (``observe``)."""

    def __init__(self, config: AutopilotConfig, cost: OnlineCost, scheduler_config: SchedulerConfig,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.cost = cost
        self.scheduler_config = scheduler_config
        self.clock = clock
        self.outlook = self._outlook(Load(itl_s=config.itl_s), scheduler_config.max_num_batched_tokens,
                                     scheduler_config.max_num_seqs)
        self.mean_output_len: float | None = None       # of finished requests (decayed)
        # Requests the outlook does not count yet, as [prompt tokens, requests]: accepted by the
        # server and not yet in the engine, and in the engine since the last plan.
        self._untaken, self._since_plan = [0, 0], [0, 0]
        self._pending_lock = threading.Lock()          # the server's threads and the engine thread
        # Whether a step's time is the machine's own: not while the runner still compiles buckets
        # on the same cores (``attach_autopilot`` sets it from the runner).
        self.learning: Callable[[], bool] = lambda: True

    # ---- each step ----
    def plan(self, scheduler: Scheduler, limits: StepLimits | None) -> StepPlan:
        """The next step's limits, within ``limits`` (the runner's; None: the configured ones)."""
        cfg = self.scheduler_config
        max_tokens, max_seqs = limits[:2] if limits else (cfg.max_num_batched_tokens, cfg.max_num_seqs)
        load = self._load(scheduler)
        budget = self._budget(load, max_tokens)
        step_s = self.cost.predict(self._shape(load, budget, load.queued_tokens))
        chunk, partial = self._prefill_sharing(load, budget, step_s)
        with self._pending_lock:
            self.outlook = self._outlook(load, max_tokens, max_seqs)
            self._since_plan = [0, 0]
        return StepPlan(StepLimits(budget, max_seqs), StepKnobs(chunk, partial, self._delay_factor(load, budget, step_s),
                                                                self._max_seqs(load, max_seqs)), step_s)

    def observe(self, out: SchedulerOutput, step_s: float, finished: list[Request]) -> float:
        """The step ``out`` took ``step_s``: learn from it; returns its predicted time (median,
        before this step corrected the model; 0 for a step without tokens)."""
        for request in finished:
            if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                n = max(s.num_output_tokens for s in request.seqs) if request.seqs else 0
                self.mean_output_len = n if self.mean_output_len is None else (
                    OUTPUT_LEN_DECAY * self.mean_output_len + (1 - OUTPUT_LEN_DECAY) * n)
        shape = StepShape.of_output(out)
        if not shape.num_tokens:
            return 0.0
        predicted = self.cost.predict(shape)
        if self.learning():
            self.cost.observe(shape, step_s)
        return predicted

    # ---- overload ----
    def retry_after(self, num_prompt_tokens: int, slo: LatencyTargets | None = None) -> int | None:
        """With the reject policy: seconds after which to retry a new request of this many prompt
        tokens predicted to miss its TTFT target by more than ``OVERLOAD_MARGIN`` while others wait
        ahead of it; None: take it (and count it as queued until the next plan)."""
        target = (slo.ttft_s if slo is not None and slo.ttft_s is not None else None) or self.config.ttft_s
        with self._pending_lock:
            o = self.outlook
            o = o._replace(queued_tokens=o.queued_tokens + self._untaken[0] + self._since_plan[0],
                           num_waiting=o.num_waiting + self._untaken[1] + self._since_plan[1])
            if self.config.overload_policy == "reject" and target is not None and (o.num_waiting or o.queued_tokens):
                predicted = o.ttft_s(num_prompt_tokens)
                if predicted > OVERLOAD_MARGIN * target:
                    return max(MIN_RETRY_AFTER_S, math.ceil(predicted - target))
            self._untaken[0] += num_prompt_tokens
            self._untaken[1] += 1
        return None

    def taken(self, num_prompt_tokens: int) -> None:
        """The engine took in a request: the next plan's queues hold it."""
        with self._pending_lock:
            if self._untaken[1]:                        # (a request added offline was never accepted here)
                self._untaken = [max(0, self._untaken[0] - num_prompt_tokens), self._untaken[1] - 1]
            self._since_plan[0] += num_prompt_tokens
            self._since_plan[1] += 1

    # ---- the plan's parts ----
    def _load(self, scheduler: Scheduler) -> Load:
        now, load = self.clock(), Load(itl_s=self.config.itl_s)
        keep = max(SHARES) + 1
        load.running_seqs = scheduler.num_running_seqs          # as admission charges them (n before a fork)
        for group in scheduler.running:
            if group.slo is not None and group.slo.itl_s is not None:
                load.itl_s = min(load.itl_s or math.inf, group.slo.itl_s)
            for seq in group.live_seqs:
                context = len(seq.token_ids)
                remaining = context - seq.num_computed_tokens
                if remaining <= 1:
                    load.decode_rows += 1
                    load.decode_context_sum += context
                    load.decode_context_max = max(load.decode_context_max, context)
                    load.remaining_outputs.append(group.max_output_tokens - (context - seq.num_prompt_tokens))
                else:
                    load.queued_tokens += remaining
                    if len(load.prefills) < keep:
                        load.prefills.append(self._prefill(group, seq.num_computed_tokens, remaining, now))
        for queue in (scheduler.swapped, scheduler.waiting):
            for group in queue:
                remaining = sum(len(s.token_ids) - s.num_computed_tokens for s in group.live_seqs)
                load.queued_tokens += remaining
                if not load.num_waiting:
                    load.head_seqs = group.max_num_running_seqs
                load.num_waiting += 1
                if len(load.prefills) < keep:
                    load.prefills.append(self._prefill(group, group.num_computed_tokens, remaining, now))
        if scheduler.gate is not None:          # speculative decoding: drafts take what the budget leaves
            load.draft_tokens = load.decode_rows * scheduler.gate.k
        return load

    def _prefill(self, group: Request, computed: int, remaining: int, now: float) -> Prefill:
        own = group.slo.ttft_s if group.slo is not None else None
        return Prefill(remaining, computed, now - group.arrival_time, own or self.config.ttft_s)

    def _budget(self, load: Load, max_tokens: int) -> int:
        """The largest bucket whose step keeps the decodes within the ITL target (see the module)."""
        if load.itl_s is None or not load.decode_rows or not (load.queued_tokens or load.draft_tokens):
            return max_tokens
        if self.cost.predict(self._shape(load, load.decode_rows, 0)) > load.itl_s:
            return max_tokens         # the decodes alone miss the target: a smaller step cannot save it
        buckets = [b for b in self.cost.token_buckets if load.decode_rows < b <= max_tokens] or [max_tokens]
        budget, work = buckets[0], load.decode_rows + load.queued_tokens + load.draft_tokens
        for b in buckets[1:]:
            if budget >= work or self.cost.bound(self._shape(load, b, load.queued_tokens)) > load.itl_s:
                break                 # all the work fits already, or this bucket's step is too slow
            budget = b
        if not self.scheduler_config.enable_chunked_prefill and load.prefills:
            # A prompt goes whole or not at all: a budget below it would hold the queue until the decodes end.
            budget = max(budget, min(max_tokens, load.decode_rows + load.prefills[0].remaining))
        return budget

    @staticmethod
    def _shape(load: Load, budget: int, queued_tokens: int) -> StepShape:
        """The step the scheduler would build with this budget: the decodes, then prompt tokens
        (as many as are queued) in one more row, then draft tokens with what is left."""
        prompt = max(0, min(budget - load.decode_rows, queued_tokens))
        drafts = max(0, min(budget - load.decode_rows - prompt, load.draft_tokens))
        context = (load.prefills[0].computed if load.prefills else 0) + prompt
        rows = load.decode_rows + (prompt > 0) + drafts          # a draft token is a sample row
        return StepShape(load.decode_rows + prompt + drafts, rows, max(load.decode_context_max, context),
                         load.decode_context_sum + context + drafts, num_prefill_tokens=prompt)

    def _max_seqs(self, load: Load, max_seqs: int) -> int:
        """The most sequences whose decode step keeps within the ITL target (see the module)."""
        if load.itl_s is None:
            return max_seqs
        context = load.decode_context_sum / load.decode_rows if load.decode_rows else (
            load.prefills[0].computed + load.prefills[0].remaining if load.prefills else 1)
        # Never below those running (nobody is preempted for it); with nothing running, never
        # below what the queue's head needs (it could never start).
        limit = load.running_seqs or min(load.head_seqs, max_seqs)
        if self.cost.predict(StepShape(1, 1, int(context), int(context))) > load.itl_s:
            return max_seqs           # one sequence alone misses the target: admitting fewer cannot help
        for rows in self.cost.row_buckets:
            if rows > max_seqs:
                break
            shape = StepShape(rows, rows, int(context), int(rows * context))
            if self.cost.bound(shape) > load.itl_s:
                break
            limit = max(limit, rows)
        return limit

    def _prefill_sharing(self, load: Load, budget: int, step_s: float) -> tuple[int | None, int | None]:
        """(long_prefill_token_threshold, max_num_partial_prefills) for the step: shared when a
        long prompt heads two or more (see the module); None: the configured ones."""
        share = budget - load.decode_rows
        if len(load.prefills) < 2 or share < 2 or load.prefills[0].ttft_s is None:
            return None, None
        head = load.prefills[0]
        if head.remaining <= share:
            return None, None
        alone = head.waited_s + math.ceil(head.remaining / share) * step_s
        for ways in SHARES:
            if ways > len(load.prefills) or share // ways < 1:
                continue
            shared = head.waited_s + math.ceil(head.remaining / (share // ways)) * step_s
            if shared <= head.ttft_s or alone > head.ttft_s:
                return self._capped_threshold(share // ways), ways
        return None, None

    def _capped_threshold(self, chunk: int) -> int:
        configured = self.scheduler_config.long_prefill_token_threshold
        return min(chunk, configured) if configured else chunk

    def _delay_factor(self, load: Load, budget: int, step_s: float) -> float | None:
        """The configured delay factor, or 0 when holding prompts back would make the oldest
        waiting request miss its TTFT target."""
        delay = self.scheduler_config.delay_factor
        if delay <= 0 or not load.prefills or load.prefills[0].ttft_s is None:
            return None
        head, share = load.prefills[0], max(budget - load.decode_rows, 1)
        finish = head.waited_s + (delay + math.ceil(head.remaining / share)) * step_s
        return 0.0 if finish > head.ttft_s else None

    def _outlook(self, load: Load, max_tokens: int, max_seqs: int) -> Outlook:
        """A new request's wait (see ``Outlook``)."""
        rate, step_s = self._prompt_rate(load, max_tokens)
        return Outlook(load.queued_tokens, load.num_waiting, rate, self._seat_wait(load, max_seqs), step_s)

    def _prompt_rate(self, load: Load, max_tokens: int) -> tuple[float, float]:
        """(prompt tokens per second, step time) with the prompts queued sharing each step with at
        least one decode (those ahead of a new request decode while it waits) at the budget the
        ITL target then allows."""
        if load.itl_s is not None and not load.decode_rows:
            load = dataclasses.replace(load, decode_rows=1, decode_context_sum=1, decode_context_max=1)
        busy = dataclasses.replace(load, queued_tokens=max_tokens)        # prompts to fill any budget
        budget = self._budget(busy, max_tokens)
        shape = self._shape(busy, budget, budget)
        step_s = self.cost.predict(shape)
        return (shape.num_prefill_tokens / step_s if shape.num_prefill_tokens and step_s > 0 else math.inf), step_s

    def _seat_wait(self, load: Load, max_seqs: int) -> float:
        """Until a new request, behind those waiting, gets a sequence slot: the decodes left of
        the running sequences that must finish first (their max_tokens, or the mean output
        length seen when shorter), at the decode step's time."""
        free = max_seqs - load.running_seqs
        must_finish = load.num_waiting + 1 - free
        if must_finish <= 0 or not load.remaining_outputs:
            return 0.0
        mean = self.mean_output_len
        left = sorted(min(r, mean) if mean is not None else r for r in load.remaining_outputs)
        rounds, k = divmod(must_finish - 1, len(left))
        tokens = left[k] + rounds * (sum(left) / len(left))
        decode_s = self.cost.predict(StepShape(load.decode_rows, load.decode_rows, load.decode_context_max,
                                               load.decode_context_sum))
        return tokens * decode_s
