"""The scheduler: each step hands out a token budget, decode-first.

Order within a step: (priority policy) preempt lower-priority running groups for a waiting
higher-priority one; running groups' decodes; running groups' partial prefills with what is
left; then queued groups, chunked to the rest of the budget: fcfs (and every policy that does
not rank, ``SchedulingPolicy.ranks``) swaps groups in before any admission, then admits in the
waiting queue's order; priority takes swapped and waiting groups in one (priority, arrival)
order, so a group preempted for a request comes back only after it. A step that preempted
admits nothing.
The scheduler knows no prefill/decode phases: a sequence simply advances
``num_computed_tokens`` towards ``num_tokens``.

What one ``schedule()`` call has handed out so far is one declared object (``StepState``),
passed explicitly to each stage of the step. The scheduler is the only writer of a sequence's
progress (``num_computed_tokens``, placeholders) and of request and sequence status; the KV
manager owns block tables (ask it, never reach into its pools).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxengine.config import MODEL_PROPOSERS, CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxengine.core import beam_search
from jaxengine.core.beam_search import BeamSearch
from jaxengine.core.kv_cache_manager import AllocStatus, ComputedBlocks, KVCacheManager, cdiv
from jaxengine.core.policy import resolve_policy
from jaxengine.core.scheduler_output import ModelRunnerOutput, NewSequenceData, SchedulerOutput, StepKnobs, \
    StepLimits
from jaxengine.request import PLACEHOLDER, Request, RequestStatus, Sequence, check_stop
from jaxengine.spec_decode.gate import SpeculationGate
from jaxengine.core.structured_output import StructuredOutputManager

RUNNING = RequestStatus.RUNNING
SPEC_DECAY = 0.9          # weight of a sequence's earlier drafts in its acceptance


@dataclass(slots=True)
class StepState:
    """What one ``schedule()`` call has handed out so far."""

    out: SchedulerOutput                  # the step being built
    now: float
    budget: int                           # tokens left to hand out
    limits: StepLimits                    # this step's most tokens and sequences
    num_seqs: int = 0                     # sequences running in this step (against max_num_seqs)
    num_partial: int = 0                  # groups part-way through their prefill
    max_partial: int = 1                  # ... at most (max_num_partial_prefills)
    max_chunk: int = 0                    # most tokens one prefill gets (long_prefill_token_threshold)
    max_admitted: int = 0                 # admissions and swap-ins stop at this many sequences
    preempted: bool = False               # a step that preempted admits nothing
    new_seqs: list[Sequence] = field(default_factory=list)        # the runner has not seen them
    changed_seqs: list[Sequence] = field(default_factory=list)    # seen, their block table changed
    added_seqs: list[Sequence] = field(default_factory=list)      # rows from ``_add_row`` (prompt chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic, speculative: SpeculativeConfig | None = None,
                 token_buckets: list[int] | None = None, max_loras: int = 0) -> None:
        """``speculative``: the runner proposes drafts after each step for the sequences the
        scheduler names (``SchedulerOutput.propose``) and hands them back in its output; the
        scheduler budgets them into the next step. ``token_buckets``: the runner's (the
        speculation gate prices a draft by the bucket it moves the step to; default: every token
        count its own). ``max_loras``: most distinct LoRA adapters running at once (0: no
        adapters), so every step's fit the device's slots; a request whose adapter would pass it
        waits at the head of the queue, and is the first admitted once an adapter's last request
        ends (nothing overtakes it: no starvation)."""
        self.config = config
        self.max_loras = max_loras
        self.gate = None
        self.proposals: dict[int, list[int]] = {}     # the runner's drafts from the last step, by seq_id
        self._lookahead = False                         # a proposal writes KV: its slots come with the step
        if speculative is not None:
            self.gate = SpeculationGate(speculative.num_speculative_tokens,
                                        token_buckets or list(range(1, config.max_num_batched_tokens + 1)))
            self._lookahead = speculative.method in MODEL_PROPOSERS
        self.kv = KVCacheManager(cache_config)
        self.block_size = cache_config.block_size
        self.clock = clock
        self.policy = resolve_policy(config.policy, field="policy")
        self.waiting = self.policy.make_queue(self.kv)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}          # unfinished, by id
        self._finished: list[Request] = []              # finished outside update_from_output
        self._finished_seq_ids: list[int] = []          # for the runner to forget
        self._step: StepState | None = None              # inside schedule(): the step being built
        self._num_beam_searches = 0                      # unfinished beam-search groups
        self.num_structured = 0                          # unfinished requests with a grammar
        # delay_factor: latency of the last step that admitted prompts
        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request. One that can never be scheduled finishes at once (FINISHED_IGNORED)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        # prompt + output <= max_model_len: the same rule the API checks max_tokens against
        request.max_output_tokens = min(request.max_output_tokens,
                                        self.config.max_model_len - request.num_prompt_tokens)
        if request.beam_params is not None:        # a beam search's state lives with its group
            request.beam = BeamSearch(request.beam_params, request.max_output_tokens, request.stop_token_set,
                                      request.stop_check)
        request.status = RequestStatus.WAITING     # (it may have waited for its grammar)
        self.requests[request.request_id] = request
        self._num_beam_searches += request.beam is not None
        self.num_structured += request.sampling_params.structured_outputs is not None
        reason = self._never_reason(request)
        if reason:
            self._finish_request(request, RequestStatus.FINISHED_IGNORED, reason)
        else:
            self.waiting.push(request)

    def _never_reason(self, request: Request) -> str | None:
        cfg, n = self.config, request.num_prompt_tokens
        if request.lora_request is not None and not self.max_loras:
            return "it asks for a LoRA adapter and this scheduler runs none (max_loras=0)"
        if n >= cfg.max_model_len:
            return (f"prompt has {n} tokens, which leaves no room for output within "
                    f"max_model_len={cfg.max_model_len}")
        if request.sampling_params.n > cfg.max_num_seqs:
            return f"n={request.sampling_params.n} samples can never run together: max_num_seqs={cfg.max_num_seqs}"
        pool_tokens = self.kv.num_usable_blocks * self.block_size
        if self.kv.num_blocks_to_hold(request) > self.kv.num_usable_blocks:
            held = sum(s.num_tokens for s in request.live_seqs)
            what = f"prompt has {n} tokens" if held == n else f"its sequences hold {held} tokens"
            return f"{what}, more than the KV cache pool holds ({pool_tokens} tokens)"
        longest = max(s.num_tokens for s in request.live_seqs)
        if not cfg.enable_chunked_prefill and longest > cfg.max_num_batched_tokens:
            return (f"sequence has {longest} tokens, more than max_num_batched_tokens="
                    f"{cfg.max_num_batched_tokens} with chunked prefill disabled")
        return None

    def abort(self, request_id: str) -> bool:
        """Finish a request wherever it is and free all its blocks. False if unknown/finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish_request(request, RequestStatus.FINISHED_ABORTED, "aborted")
        return True

    def finish_request(self, request_id: str, status: RequestStatus, reason: str | None = None) -> bool:
        """Finish from outside (e.g. a stop string found by the detokenizer)."""
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish_request(request, status, reason)
        return True

    def finish_sequence(self, seq: Sequence, status: RequestStatus, stop_reason: int | str | None = None,
                        num_output_tokens: int | None = None) -> None:
        """Finish one running sequence from outside (a stop string the detokenizer found); its
        group finishes with its last sequence. ``num_output_tokens``: its output ends there (the
        stop string ended at that token; a speculative step may have output more after it)."""
        if num_output_tokens is not None and seq.num_output_tokens > num_output_tokens:
            seq.drop_pending()
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens:]
            del seq.logprobs[num_output_tokens:]
            if seq.is_finished:
                # A later token of the same accepted run ended it (a stop token, max_tokens, its
                # grammar): the stop string came first, so it ends as the stop string ends it.
                seq.status, seq.stop_reason = status, stop_reason
                return
        if seq.is_finished:
            return
        seq.stop_reason = stop_reason
        self._finish_seq(seq.request, seq, status)
        if seq.request.is_finished:
            self.running = [g for g in self.running if g.status is RUNNING]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.max_num_running_seqs for g in self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self, limits: StepLimits | None = None, knobs: StepKnobs | None = None) -> SchedulerOutput:
        """The next step. Guarantees: at most ``limits`` tokens and sequences (a runner still
        compiling its larger buckets gives less than the configured limits; None: the configured
        ones); running groups are served before swapped ones and swapped ones (fcfs) before any
        admission; a step that preempted admits nothing; every row's blocks are allocated for
        its tokens. Whether a request can ever run is judged against the configured limits.
        ``knobs``: the step's prompt chunking and delay (None: the configured ones)."""
        now = self.clock()
        knobs = knobs or StepKnobs()
        step = self._step = self._new_step(now, limits, knobs)
        passed_delay = self._passed_delay(now, self._knob(knobs.delay_factor, "delay_factor"))
        if self.policy.ranks and len(self.waiting):
            self._preempt_for_priority(step)
        self._schedule_running(step)
        if not step.preempted:                     # a step that preempted admits nothing
            if self.policy.ranks:
                self._schedule_by_rank(step, passed_delay)
            else:
                self._schedule_in_arrival_order(step, passed_delay)
        if self.gate is not None:
            self._add_drafts(step)
        out = self._finalize(step)
        self._step = None
        return out

    def _new_step(self, now: float, limits: StepLimits | None, knobs: StepKnobs) -> StepState:
        cfg = self.config
        limits = limits or StepLimits(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        threshold = self._knob(knobs.long_prefill_token_threshold, "long_prefill_token_threshold")
        max_chunk = (threshold if cfg.enable_chunked_prefill else 0) or cfg.max_num_batched_tokens
        admitted = limits.max_num_seqs if knobs.max_num_seqs_admitted is None else \
            min(knobs.max_num_seqs_admitted, limits.max_num_seqs)
        return StepState(SchedulerOutput(), now, limits.max_num_batched_tokens, limits,
                         max_partial=self._knob(knobs.max_num_partial_prefills, "max_num_partial_prefills"),
                         max_chunk=max_chunk, max_admitted=admitted)

    def _knob(self, value, name: str):
        """A step's setting: the knob's value, else the configured one."""
        return getattr(self.config, name) if value is None else value

    @property
    def is_scheduling(self) -> bool:
        """Inside ``schedule()`` (after a failure there: the scheduler's state is unknown)."""
        return self._step is not None

    def _schedule_running(self, step: StepState) -> None:
        """Decodes of all running groups, then their partial prefills with the budget left.

        The hot path is a one-sequence group's decode (once per decoding request per step): its
        row is ``_add_row``'s for one token written out over local columns, since a call per row
        would cost the engine loop a quarter of its host time. Decodes always fit the budget
        (a step's limits allow at least a token per sequence), so those rows are charged to it
        once, after the pass; a row taken back meanwhile (``_unschedule``) was credited back there."""
        kv, bs, out = self.kv, self.block_size, step.out
        seq_ids, num_tokens, num_samples, rows = (out.seq_ids, out.num_scheduled_tokens,
                                                  out.num_samples, out.scheduled_seqs)
        computed, previous = out.num_computed_tokens, out.previous_sample_rows
        num_decodes = num_seqs = 0
        prefilling = []
        windowed = bool(kv.windowed)
        for group in self.running[:]:
            if group.status is not RUNNING:
                continue                           # preempted earlier in this step
            seqs = group.seqs
            if windowed:                           # blocks their windows have passed go back first
                for seq in group.live_seqs:
                    kv.slide(seq)
            if len(seqs) == 1 and group.forked:    # hot path: one sequence
                seq = seqs[0]
                nc = seq.num_computed_tokens
                if len(seq.token_ids) - nc != 1:
                    prefilling.append(group)
                    continue
                if seq.num_pending and self._finishes_by_length(seq):
                    num_seqs += 1                  # its token in flight is its last: no row, but
                    continue                       # it holds its place until update_from_output
                if nc >= len(seq.block_table) * bs:                 # its last block is full
                    if not self._make_room(step, group, lambda: kv.allocate_slots(seq, 1)):
                        num_seqs += group.status is RUNNING     # (outgrew the pool: its last token is in flight)
                        continue
                    if not seq.is_new:
                        step.changed_seqs.append(seq)
                if seq.is_new:
                    step.new_seqs.append(seq)
                seq_ids.append(seq.seq_id)
                num_tokens.append(1)
                num_samples.append(1)              # forked: one token
                rows.append(seq)
                computed.append(nc)
                previous.append(seq.pending_sample_row if seq.num_pending else -1)
                seq.num_computed_tokens = nc + 1
                num_decodes += 1
                num_seqs += 1
            elif self._leaves_partial(group.live_seqs):
                prefilling.append(group)
            elif self._make_room(step, group, lambda: kv.can_append_slots(group)):
                self._schedule_seqs(step, group)
                num_seqs += group.max_num_running_seqs
            elif group.status is RUNNING:          # outgrew the pool with its last tokens in flight:
                num_seqs += group.max_num_running_seqs     # it holds its seats until they are back
        step.budget -= num_decodes
        step.num_seqs += num_seqs
        for group in prefilling:
            if group.status is RUNNING:
                self._schedule_seqs(step, group)
            if group.status is RUNNING:            # not preempted while making room
                step.num_seqs += group.max_num_running_seqs
                step.num_partial += self._leaves_partial(group.live_seqs)

    def _add_drafts(self, step: StepState) -> None:
        """Speculative decoding: extend the step's decode rows by the drafts the runner proposed
        for them after the last step (``proposals``), then name the rows it proposes for after
        this one. Drafts take the budget the step's other rows left (a draft displaces no prompt
        token: where prompts fill the budget, a rejected draft token would be work thrown away that
        a prompt token could have done) and stay within its row limit (every draft token is a
        sample row). A row drafts only when the host knows all its tokens (no placeholder) and
        its request does not search beams (a grammar's row keeps the part of its draft the grammar
        allows), and the draft's KV slots can be had without preempting anyone; the gate
        (``spec_decode.gate``) plans each row's draft length by what pays this step, or switches
        speculation off."""
        out = step.out
        candidates, nexts = [], []           # (row, sequence, the most draft tokens it may take now / next step)
        for i, seq in enumerate(out.scheduled_seqs):
            if out.num_samples[i] != 1 or out.previous_sample_rows[i] >= 0 or seq.request.beam is not None:
                continue
            # The row's own sample is one more output token: drafts beyond max_tokens are waste.
            most = seq.request.max_output_tokens - seq.num_output_tokens - 1
            if out.num_scheduled_tokens[i] == 1:
                candidates.append((i, seq, most))
            if most > 1:
                nexts.append((i, seq, most - 1))
        room = step.limits.max_num_seqs - sum(out.num_samples)      # sample rows the row bucket has left
        base = (sum(out.num_scheduled_tokens), _sampling_rows(out), max(0, min(step.budget, room)))
        # Who proposes after this step, and how far: a proposer with a KV cache of its own (a draft
        # model, a head) runs only where the gate would take its drafts (the step as now is the
        # guess of the next), and writes its KV in slots allocated here; prompt lookup costs nothing.
        k = self.gate.k
        wanted = [(i, seq, min(k, most)) for i, seq, most in nexts]
        if self._lookahead and wanted:
            lengths = self.gate.plan(*base[:2], [(n, self._acceptance(seq)) for _, seq, n in wanted], base[2])
            wanted = [(i, seq, n) for (i, seq, _), n in zip(wanted, lengths)]
        if candidates:
            proposals = []
            for i, seq, most in candidates:
                draft = self.proposals.get(seq.seq_id, ())[:most]
                if draft and seq.grammar is not None:
                    draft = draft[:seq.grammar.valid_prefix(draft)]      # what the grammar allows
                if draft:
                    proposals.append((i, seq, draft))
            lengths = self.gate.plan(*base[:2], [(len(d), self._acceptance(seq)) for _, seq, d in proposals], base[2])
            for (i, seq, draft), n in zip(proposals, lengths):
                draft = draft[:min(n, step.budget, room)]
                if draft and self._draft_slots(step, seq, len(draft)):
                    self._take_draft(step, i, seq, draft)
                    room -= len(draft)
        for i, seq, n in wanted:
            if n > 0 and (not self._lookahead or self._draft_slots(step, seq, n)):
                out.propose[seq.seq_id] = n

    def _acceptance(self, seq: Sequence) -> float:
        """The sequence's acceptance as the gate estimates it."""
        return self.gate.row_alpha(seq.spec_accepted, seq.spec_trials)

    def _draft_slots(self, step: StepState, seq: Sequence, n: int) -> bool:
        """KV slots for ``n`` more positions after the row's (drafts, or a proposal's; never by
        preempting anyone)."""
        blocks = len(seq.block_table)
        if not self.kv.allocate_slots(seq, n):
            return False
        if len(seq.block_table) != blocks and not seq.is_new and seq not in step.changed_seqs:
            step.changed_seqs.append(seq)
        return True

    @staticmethod
    def _take_draft(step: StepState, i: int, seq: Sequence, draft: list[int]) -> None:
        """Row ``i`` (``seq``'s decode) carries ``draft`` after its input token."""
        out, n = step.out, len(draft)
        out.draft_token_ids[seq.seq_id] = draft
        out.num_scheduled_tokens[i] += n
        out.num_samples[i] += n
        seq.num_computed_tokens += n
        step.budget -= n

    def _schedule_seqs(self, step: StepState, group: Request) -> None:
        """Give each live sequence of a running group its next tokens: 1 for a decode, a chunk
        of what is left of the budget for a prefill. Preempts others if blocks run out."""
        kv = self.kv
        for seq in group.live_seqs:
            if seq.num_pending and self._finishes_by_length(seq):
                continue
            n = self._chunk(step, len(seq.token_ids) - seq.num_computed_tokens, step.budget)
            if n <= 0:
                continue
            if not self._make_room(step, group, lambda: kv.allocate_slots(seq, n)):
                return
            self._add_row(step, seq, n, table_changed=True)

    @staticmethod
    def _add_row(step: StepState, seq: Sequence, n: int, table_changed: bool) -> None:
        """``n`` more tokens of ``seq`` (their blocks allocated) as the step's next row."""
        out = step.out
        if seq.is_new:
            step.new_seqs.append(seq)
        elif table_changed:
            step.changed_seqs.append(seq)
        computed = seq.num_computed_tokens
        out.seq_ids.append(seq.seq_id)
        out.num_scheduled_tokens.append(n)
        out.num_computed_tokens.append(computed)
        # With a placeholder, the row's last input is the previous step's sample, still on the device.
        out.previous_sample_rows.append(seq.pending_sample_row if seq.num_pending else -1)
        out.scheduled_seqs.append(seq)
        step.added_seqs.append(seq)
        seq.num_computed_tokens = computed = computed + n
        step.budget -= n
        if computed < len(seq.token_ids):
            out.num_samples.append(0)              # mid-prefill: nothing to sample
        else:                                      # the prompt's end forks an unforked group
            group = seq.request
            out.num_samples.append(1 if group.forked or group.beam is not None else group.sampling_params.n)

    @staticmethod
    def _leaves_partial(seqs: list[Sequence], num_new_tokens=itertools.repeat(0)) -> bool:
        """Part-way through a prefill after ``num_new_tokens`` more tokens each (default: as
        now): more than a decode's worth of known tokens left."""
        return any(len(s.token_ids) - s.num_computed_tokens - n > 1 for s, n in zip(seqs, num_new_tokens))

    @staticmethod
    def _finishes_by_length(seq: Sequence) -> bool:
        """Its last token (a placeholder) reaches max_tokens: no further step for it."""
        return len(seq.token_ids) - seq.num_prompt_tokens >= seq.request.max_output_tokens

    def add_placeholders(self, out: SchedulerOutput) -> None:
        """Async scheduling: before ``update_from_output(out)``, give every row of ``out`` that
        samples one token a placeholder, so the next ``schedule()`` can run its decode (the
        runner feeds it the token from the device, named by its sample row). Not for fork rows
        (n > 1 samples) nor beams and grammars (``Request.waits_for_tokens``)."""
        sample_row = 0
        for seq, k in zip(out.scheduled_seqs, out.num_samples):
            if k == 1 and seq.status is RUNNING and not seq.request.waits_for_tokens:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1
                seq.pending_sample_row = sample_row
            sample_row += k

    def _schedule_in_arrival_order(self, step: StepState, passed_delay: bool) -> None:
        """fcfs and every policy that does not rank: swapped groups in the order they were
        swapped out, then (only once none is left) waiting requests in the queue's order."""
        for group in list(self.swapped):
            if not self._swap_in(step, group):
                return
        if self.swapped or not passed_delay:
            return
        while len(self.waiting) and step.budget > 0:
            if not self._admit_head(step):
                return

    def _schedule_by_rank(self, step: StepState, passed_delay: bool) -> None:
        """priority: swapped groups and waiting requests in one (priority, arrival) order, so a
        group preempted for a better request cannot come back before that request runs. Stops
        at the first that cannot go now: nothing overtakes a better one."""
        rank = self.policy.rank
        swapped = sorted(self.swapped, key=rank)
        i = 0
        while not step.preempted:
            head = self.waiting.peek() if len(self.waiting) else None
            if i < len(swapped) and (head is None or rank(swapped[i]) <= rank(head)):
                if not self._swap_in(step, swapped[i]):
                    return
                i += 1
            elif head is None or not passed_delay or step.budget <= 0 or not self._admit_head(step):
                return

    def _swap_in(self, step: StepState, group: Request) -> bool:
        """Swap a group in and schedule it; False if it cannot come back now."""
        kv, seqs = self.kv, group.live_seqs
        if step.num_seqs + group.max_num_running_seqs > step.max_admitted or self._adapter_blocked(group):
            return False
        if step.budget < len(seqs):
            return False                           # every live sequence needs a token
        chunks = self._plan_chunks(step, seqs, [0] * len(seqs))
        partial = self._leaves_partial(seqs, chunks)
        if partial and step.num_partial >= step.max_partial:
            return False
        if not kv.can_swap_in(group, chunks, use_watermark=bool(self.running)):
            if self.running or kv.can_swap_in(group, chunks, use_watermark=False):
                return False
            self._finish_unschedulable(group, self._outgrown_reason())
            return True                            # it alone would not fit the empty pool
        step.out.blocks_to_swap_in.extend(kv.swap_in(group))
        self.swapped.remove(group)
        self._set_status(group, RUNNING)
        self.running.append(group)
        self._schedule_seqs(step, group)
        step.num_seqs += group.max_num_running_seqs
        step.num_partial += self._leaves_partial(group.live_seqs)
        return True

    def _admit_head(self, step: StepState) -> bool:
        """Admit the head of the waiting queue; False if it cannot start now."""
        kv = self.kv
        group = self.waiting.peek()
        if group.status is RequestStatus.PREEMPTED and (reason := self._never_reason(group)):
            self.waiting.pop()                     # grew past what can ever be scheduled
            self._finish_unschedulable(group, reason)
            return True
        if step.num_seqs + group.max_num_running_seqs > step.max_admitted or self._adapter_blocked(group):
            return False
        seqs = group.live_seqs
        hits = [kv.get_computed_blocks(s) for s in seqs]
        hit_tokens = [len(h.blocks) * self.block_size for h in hits]
        chunks = self._plan_chunks(step, seqs, hit_tokens)
        if not chunks[0]:
            return False                           # without chunking: the prompt must fit whole
        partial = self._leaves_partial(seqs, [h + n for h, n in zip(hit_tokens, chunks)])
        if partial and step.num_partial >= step.max_partial:
            return False
        status = kv.can_allocate(group, list(zip(seqs, hits, chunks)), use_watermark=bool(self.running))
        if status is AllocStatus.LATER:
            return False
        self.waiting.pop()
        if status is AllocStatus.NEVER:
            self._finish_unschedulable(group, f"needs {kv.num_blocks_to_hold(group)} KV blocks, the pool "
                                              f"has {kv.num_usable_blocks}")
            return True
        self._admit(step, group, hits, chunks)
        step.num_partial += partial
        return True

    def running_adapters(self) -> set[str]:
        """The LoRA adapters of the running groups, by content digest (what takes a device slot)."""
        return {g.lora_digest for g in self.running if g.lora_digest is not None}

    def _adapter_blocked(self, group: Request) -> bool:
        """Running ``group`` would make more than ``max_loras`` distinct adapters run at once."""
        if group.lora_digest is None:
            return False
        running = self.running_adapters()
        return group.lora_digest not in running and len(running) >= self.max_loras

    def _plan_chunks(self, step: StepState, seqs: list[Sequence], hit_tokens: list[int]) -> list[int]:
        budget, chunks = step.budget, []
        for seq, hit in zip(seqs, hit_tokens):
            n = self._chunk(step, seq.num_tokens - seq.num_computed_tokens - hit, budget)
            chunks.append(n)
            budget -= n
        return chunks

    def _chunk(self, step: StepState, remaining: int, budget: int) -> int:
        """Tokens a sequence gets now. Without chunked prefill a sequence goes whole or not at
        all (the sequences of a recomputed group may still go in different steps)."""
        n = min(remaining, budget, step.max_chunk)
        return n if n == remaining or self.config.enable_chunked_prefill else 0

    def _admit(self, step: StepState, group: Request, hits: list[ComputedBlocks], chunks: list[int]) -> None:
        kv, seqs = self.kv, group.live_seqs
        for seq, hit in zip(seqs, hits):       # every hit first: no allocation may evict one
            num_hit_tokens = kv.take_hit(seq, hit)
            kv.record_prefix_query(seq, num_hit_tokens)
            seq.num_computed_tokens += num_hit_tokens
            step.out.num_prefix_hit_tokens += num_hit_tokens
        for seq, n in zip(seqs, chunks):
            allocated = kv.allocate_slots(seq, n)
            assert allocated, "can_allocate said OK"
            if n:
                self._add_row(step, seq, n, table_changed=True)
        self._set_status(group, RUNNING)
        self.running.append(group)
        if group.times.first_scheduled is None:
            group.times.first_scheduled = step.now
        step.num_seqs += group.max_num_running_seqs
        self._prev_prompt = True

    def _passed_delay(self, now: float, delay_factor: float) -> bool:
        """delay_factor: hold new prompts until the oldest waiting request has waited longer
        than delay_factor x the last prompt step's latency (unless nothing runs)."""
        if self._prev_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if delay_factor <= 0 or not len(self.waiting):
            return True
        earliest = min(r.arrival_time for r in self.waiting)
        return now - earliest > delay_factor * self._last_prompt_latency or not self.running

    # ------------------------------------------------------------------ preemption
    def _make_room(self, step: StepState, group: Request, fits: Callable[[], bool]) -> bool:
        """Preempt the policy's victims until ``fits()`` holds. False if ``group`` itself had to
        go (it is then preempted, or ends by length when it alone holds the whole pool)."""
        while not fits():
            victim = self.policy.victim(self.running)
            if victim is group:
                if len(self.running) == 1:
                    self._end_outgrown(group)
                else:
                    self._preempt(step, group)
                return False
            self._preempt(step, victim)
        return True

    def _end_outgrown(self, group: Request) -> None:
        """The group alone holds the whole pool and needs more: its output ends here, finish
        reason "length", its text kept (an error would throw away what the user asked for). A
        token still on the device (async scheduling) is its last: update_from_output ends it."""
        seqs = group.live_seqs
        if any(s.num_pending for s in seqs):
            group.max_output_tokens = max(s.num_tokens - s.num_prompt_tokens for s in seqs)
        else:
            self._finish_request(group, RequestStatus.FINISHED_LENGTH, self._outgrown_reason())

    def _outgrown_reason(self) -> str:
        return (f"needs more KV cache than the whole pool ({self.kv.num_usable_blocks} blocks of "
                f"{self.block_size} tokens)")

    def _finish_unschedulable(self, group: Request, reason: str) -> None:
        """A preempted or new group that can never run: one that already generated tokens ends by
        length with them (it outgrew the pool or the budget while it ran); a new one is ignored."""
        generated = any(s.num_output_tokens for s in group.live_seqs)
        status = RequestStatus.FINISHED_LENGTH if generated else RequestStatus.FINISHED_IGNORED
        self._finish_request(group, status, reason)

    def _preempt_for_priority(self, step: StepState) -> None:
        """Preempt strictly lower-priority running groups while the best waiting one cannot fit."""
        head, limits, kv = self.waiting.peek(), step.limits, self.kv
        if head.max_num_running_seqs > limits.max_num_seqs:
            return                                 # it cannot start under this step's limits anyway
        chunk_blocks = cdiv(min(head.num_tokens, limits.max_num_batched_tokens), self.block_size)
        while self.running:
            victim = self.policy.victim(self.running)
            if victim.priority <= head.priority:
                return
            seqs_fit = self.num_running_seqs + head.max_num_running_seqs <= limits.max_num_seqs
            blocks_fit = kv.num_free_blocks - chunk_blocks >= kv.watermark_blocks
            if seqs_fit and blocks_fit:
                return
            self._preempt(step, victim)

    def _preemption_mode(self, group: Request) -> str:
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if group.max_num_running_seqs > 1 else "recompute"
        return mode

    def _preempt(self, step: StepState, group: Request) -> None:
        """Recompute: free the blocks, back to the front of waiting, outputs kept. Swap: move the
        blocks to the host pool (falls back to recompute when the host pool is full, counted in
        ``num_swap_fallbacks``; with no host pool at all swapping is off, nothing to count)."""
        out, kv = step.out, self.kv
        self.running.remove(group)
        self._unschedule(step, group)
        redirect = kv.cancel_copies_into(group)    # a swap-out reads a cancelled copy's source
        live = group.live_seqs
        swap = self._preemption_mode(group) == "swap"
        if swap and kv.windowed:                   # what its windows have passed stays behind
            for seq in live:
                kv.slide(seq)
        if swap and kv.can_swap_out(group):
            out.blocks_to_swap_out.extend((redirect.get(d, d), h) for d, h in kv.swap_out(group))
            self._set_status(group, RequestStatus.SWAPPED)
            self.swapped.append(group)
        else:
            if swap and kv.can_swap:
                out.num_swap_fallbacks += 1        # the host pool is full: recompute instead
            self._requeue(group, kv.free)
        for seq in live:
            seq.is_new = True
        out.preempted_seq_ids.extend(s.seq_id for s in live)
        out.num_preemptions += 1
        group.num_preemptions += 1
        step.preempted = True

    def _requeue(self, group: Request, free: Callable[[Sequence], None]) -> None:
        """Back to the front of the waiting queue to start again from token 0, each sequence's
        blocks (and state) given back by ``free``."""
        for seq in group.live_seqs:
            free(seq)
            seq.num_computed_tokens = 0
        self._set_status(group, RequestStatus.PREEMPTED)
        self.waiting.push_front(group)

    def _swapped_to_recompute(self, group: Request) -> None:
        """A swapped-out group gives up its host blocks and states and waits to start again."""
        if group.status is RequestStatus.SWAPPED:  # (not when another of its sequences did it)
            self.swapped.remove(group)
            self._requeue(group, self.kv.free_swapped)

    def _unschedule(self, step: StepState, group: Request) -> None:
        """Take back the rows a group already got in this step (a victim chosen late)."""
        out = step.out
        keep = [i for i, s in enumerate(out.scheduled_seqs) if s.request is not group]
        if len(keep) == len(out.scheduled_seqs):
            return
        for i, seq in enumerate(out.scheduled_seqs):
            if seq.request is group:
                seq.num_computed_tokens -= out.num_scheduled_tokens[i]
                step.budget += out.num_scheduled_tokens[i]
                out.draft_token_ids.pop(seq.seq_id, None)
                out.propose.pop(seq.seq_id, None)
        for values in (out.seq_ids, out.num_scheduled_tokens, out.num_samples, out.scheduled_seqs,
                       out.num_computed_tokens, out.previous_sample_rows):
            values[:] = [values[i] for i in keep]   # in place: the decode pass holds these lists

    # ------------------------------------------------------------------ finishing
    @staticmethod
    def _set_status(group: Request, status: RequestStatus) -> None:
        group.status = status
        for seq in group.seqs:
            if not seq.is_finished:
                seq.status = status

    def _finish_request(self, group: Request, status: RequestStatus, reason: str | None) -> None:
        if group.status is RUNNING:
            self.running.remove(group)
            if self._step is not None:
                self._unschedule(self._step, group)
        elif group.status is RequestStatus.SWAPPED:
            self.swapped.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        if group.beam is not None and status is RequestStatus.FINISHED_LENGTH:
            group.beam.end_running([(s.output_token_ids, s.logprobs, s.cumulative_logprob)
                                    for s in group.live_seqs if s.num_output_tokens])
        for seq in group.live_seqs:
            self._free_seq(seq, status)
        if group.beam is not None and group.beam.finished:
            group.seqs = beam_search.hypothesis_seqs(group)
        self._mark_finished(group, status, reason)
        self._finished.append(group)

    def _free_seq(self, seq: Sequence, status: RequestStatus) -> None:
        seq.drop_pending()
        if seq.status is RequestStatus.SWAPPED:
            self.kv.free_swapped(seq)
        else:
            self.kv.free(seq)
        seq.status = status
        self._finished_seq_ids.append(seq.seq_id)

    def _mark_finished(self, group: Request, status: RequestStatus, reason: str | None) -> None:
        self._num_beam_searches -= group.beam is not None
        self.num_structured -= group.sampling_params.structured_outputs is not None
        group.status = status
        group.status_reason = reason
        group.times.finished = self.clock()
        del self.requests[group.request_id]

    def resend_finished(self, seq_ids) -> None:
        """Tell the runner again, in the next step, to forget these sequences (steps that told
        it first were abandoned before it saw them)."""
        self._finished_seq_ids.extend(seq_ids)

    def _finalize(self, step: StepState) -> SchedulerOutput:
        out = step.out
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens)
        out.num_draft_tokens = sum(map(len, out.draft_token_ids.values()))
        out.num_decode_tokens = out.num_scheduled_tokens.count(1) + len(out.draft_token_ids)
        out.num_prefill_tokens = out.total_num_scheduled_tokens - out.num_decode_tokens - out.num_draft_tokens
        for seq in step.new_seqs:
            if seq.status is RUNNING and seq.is_new:
                seq.is_new = False
                req = seq.request
                out.new_seqs.append(NewSequenceData(
                    seq.seq_id, req.request_id, list(seq.token_ids), list(seq.block_table),
                    req.sampling_params, seq.sample_index, req.seed, seq.num_prompt_tokens,
                    tuple(sorted(req.stop_token_set)) if req.sampling_params.min_tokens else (), req.beam is not None,
                    [list(t) for t in seq.group_tables], seq.state_slot or 0))
        for seq in step.changed_seqs:
            if seq.status is RUNNING and not seq.is_new:
                out.block_tables[seq.seq_id] = list(seq.block_table)
                if seq.group_tables:
                    out.group_tables[seq.seq_id] = [list(t) for t in seq.group_tables]
        if self.kv.snapshot_interval:
            for row, (seq, computed, n) in enumerate(zip(out.scheduled_seqs, out.num_computed_tokens,
                                                         out.num_scheduled_tokens)):
                out.state_snapshots += [(row, position, slot) for position, slot in self.kv.take_snapshots(seq, computed, n)]
        if self.kv.enable_caching:
            # The prompt blocks this step fills are cached now, not when its results come back:
            # the device runs steps in order, so a step scheduled before then (async scheduling's
            # step launched ahead) may read them. (A step that fails drops the prefix cache.)
            for seq in step.added_seqs:
                if seq.status is RUNNING:
                    self.kv.cache_full_blocks(seq)
        out.blocks_to_copy = self.kv.take_pending_copies()
        if self.kv.state_pool is not None:
            out.states_to_copy, out.states_to_swap_out, out.states_to_swap_in = self.kv.take_state_moves()
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        return out

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, apply stop checks, free finished sequences. Returns the
        requests that finished since the last call (including aborted and ignored ones)."""
        now = self.clock()
        searching = self._num_beam_searches > 0
        if result.logprobs is not None:
            self._record_logprobs(out, result.logprobs)
        if result.prompt_logprobs is not None:
            for seq, row in zip(out.scheduled_seqs, result.prompt_logprobs):
                for position, entry in row or ():
                    seq.request.prompt_logprobs[position] = entry     # by position: recompute-safe
        any_finished = self._intake(out.scheduled_seqs, result.sampled_token_ids, now, out.draft_token_ids,
                                    skip_beams=searching)
        if out.draft_token_ids or (self._lookahead and out.propose):
            any_finished |= self._take_verified(out, result, now)
        self.proposals = result.draft_token_ids
        if searching:
            for group in beam_search.take_candidates(out, result):
                self._beam_step(group)
                any_finished |= group.is_finished
        if any_finished:
            self.running = [g for g in self.running if g.status is RUNNING]
        finished, self._finished = self._finished, []
        return finished

    # ------------------------------------------------------------------ beam search
    def _beam_step(self, group: Request) -> None:
        """One step of the group's search (``core/beam_search.py`` decides and extends the
        beams); the beams it drops give their blocks back. When the search ends the group
        finishes with its hypotheses as its sequences."""
        group.forked = True
        step = beam_search.decide(group)
        if step.done:
            self._finish_beam_search(group)
            return
        for seq in beam_search.apply_step(group, step, self._fork_seq, self._intake):
            self.kv.free(seq)
            seq.status = RequestStatus.FINISHED_ABORTED
            self._finished_seq_ids.append(seq.seq_id)

    def _finish_beam_search(self, group: Request) -> None:
        for seq in group.live_seqs:
            self._free_seq(seq, RequestStatus.FINISHED_ABORTED)
        group.seqs = beam_search.hypothesis_seqs(group)
        status = group.seqs[0].status if group.seqs else RequestStatus.FINISHED_LENGTH
        self.running.remove(group)
        self._mark_finished(group, status, None)
        self._finished.append(group)

    # ------------------------------------------------------------------ tokens
    def _intake(self, seqs: list[Sequence], token_lists: list[list[int]], now: float | None = None, drafts=None,
                *, skip_beams: bool = False, searched: bool = False) -> bool:
        """The one way output tokens join sequences: one token per row (``seqs[i]`` gets
        ``token_lists[i][0]``), for a step's rows (a decode's token, the first of a verified run,
        whose later tokens come back through here a position at a time, ``_take_verified``; at a
        fork the n samples, one to each of the n sequences, again through here; the token of a
        sequence preempted meanwhile) and for a beam search's chosen tokens. The token fills the
        sequence's oldest placeholder (async scheduling) or is appended, then goes through the stop
        checks, then through its grammar; a token that ends the output finishes the sequence.
        ``drafts``: the step's (a row with one is rolled back to its accepted tokens first);
        ``skip_beams``: a beam's row is left to its search; ``searched``: a beam search's tokens,
        checked against its own stop rules and taken through its grammar's mask, so only appended
        and fed to the grammar. Returns whether a group finished.

        One call per step and one token per row: a call per row, or a loop over a row's tokens,
        would cost the engine loop a tenth of its host time (scripts/bench_scheduler.py)."""
        kv, bs, caching, grammars = self.kv, self.block_size, self.kv.enable_caching, self.num_structured > 0
        any_finished = False
        for seq, tokens in zip(seqs, token_lists):
            drafted = drafts and seq.seq_id in drafts
            running = seq.status is RUNNING
            if running:
                if drafted:
                    if tokens:
                        self._roll_back(seq, len(drafts[seq.seq_id]), len(tokens) - 1)
                # Cheap pre-filter (most steps fill no block); cache_full_blocks checks the known tokens.
                elif caching and seq.num_computed_tokens // bs > seq.num_cached_blocks:
                    kv.cache_full_blocks(seq)
                if not tokens:
                    continue                               # mid-prefill: nothing sampled
            elif tokens and not seq.num_pending and seq.request.waits_for_tokens:
                # A beam or a grammar row (no placeholder) preempted by the step run ahead while
                # its own step ran: its token is dropped, and a swapped-out one computes that
                # position again once back (same KV), so it samples the token again; where it
                # cannot (``can_compute_again``), the group starts again from token 0.
                if seq.status is RequestStatus.SWAPPED:
                    if kv.can_compute_again:
                        seq.num_computed_tokens -= 1
                    else:
                        self._swapped_to_recompute(seq.request)
                continue
            elif not (tokens and seq.num_pending and not seq.is_finished):
                continue                                   # finished ones: aborted while it ran
            request = seq.request
            if request.times.first_token is None:
                request.times.first_token = now
            if len(tokens) > 1 and running and not drafted:
                self._fork(request, seq, tokens, now)
                any_finished |= request.is_finished
                continue
            if skip_beams and request.beam is not None:
                continue                                   # the search picks its tokens (``_beam_step``)
            token, token_ids = tokens[0], seq.token_ids
            pending = seq.num_pending
            if pending:
                token_ids[len(token_ids) - pending] = token
                seq.num_pending = pending = pending - 1
            else:
                token_ids.append(token)
            if searched:
                if seq.grammar is not None:
                    seq.grammar.accept(token)
                continue
            status = reason = None
            # Cheap pre-filter on the hot path: most tokens can stop nothing.
            if (token in request.stop_token_set
                    or len(token_ids) - pending - seq.num_prompt_tokens >= request.max_output_tokens):
                status = check_stop(request, seq, token)
            if status is None and grammars and seq.grammar is not None:
                status, reason = StructuredOutputManager.take_token(seq, token) or (None, None)
            if status is None:
                continue
            if running:
                self._finish_seq(request, seq, status, reason)
                any_finished |= request.is_finished
            elif len(request.live_seqs) > 1:              # preempted by the step run ahead
                self._free_seq(seq, status)
            else:
                self._finish_request(request, status, reason)
        return any_finished

    def _take_verified(self, out: SchedulerOutput, result: ModelRunnerOutput, now: float) -> bool:
        """The rows with a draft (their first token went in with the step's): the rest of each
        verified run, a position at a time through ``_intake`` (a token that ends the output
        drops those after it); then each speculative row's cleanup (``_after_speculation``).
        Returns whether a group finished."""
        drafts, proposed = out.draft_token_ids, out.propose if self._lookahead else {}
        runs = [(seq, tokens) for seq, tokens in zip(out.scheduled_seqs, result.sampled_token_ids)
                if tokens and seq.seq_id in drafts]
        any_finished = False
        for position in range(1, max((len(tokens) for _, tokens in runs), default=0)):
            going = [(seq, [tokens[position]]) for seq, tokens in runs if len(tokens) > position and not seq.is_finished]
            any_finished |= self._intake([seq for seq, _ in going], [token for _, token in going], now)
        for seq in out.scheduled_seqs:
            drafted = seq.seq_id in drafts
            if drafted or seq.seq_id in proposed:
                self._after_speculation(seq, drafted, seq.status is RUNNING)
        return any_finished

    def _roll_back(self, seq: Sequence, num_draft: int, accepted: int) -> None:
        """A row that carried ``num_draft`` draft tokens kept ``accepted`` of them (its output is
        those and the target's next token; ``spec_decode.verify``): the rejected drafts' KV is
        rolled back, so the computed tokens end at the last accepted one."""
        seq.num_computed_tokens -= num_draft - accepted
        # Its own acceptance (decayed: a request's text changes), for the gate's plan.
        seq.spec_accepted = SPEC_DECAY * seq.spec_accepted + accepted
        seq.spec_trials = SPEC_DECAY * seq.spec_trials + accepted + (accepted < num_draft)

    def _after_speculation(self, seq: Sequence, drafted: bool, running: bool) -> None:
        """After a speculative row's tokens went in: a draft's logprobs beyond the tokens kept go
        (a stop inside the accepted run ends the output there), and a running sequence gives
        back the blocks past its tokens (rejected drafts' slots, a proposal's), so no block table
        or prefix-cache hash ever holds a rejected token."""
        if drafted and len(seq.logprobs) > seq.num_output_tokens:        # asked for: those of the kept tokens
            del seq.logprobs[seq.num_output_tokens:]
        if running:
            self.kv.trim(seq, cdiv(len(seq.token_ids), self.block_size))
            if self.kv.enable_caching:
                self.kv.cache_full_blocks(seq)

    @staticmethod
    def _record_logprobs(out: SchedulerOutput, logprobs: list) -> None:
        """Before the fork: a fork row's samples go to the leader and then to its new siblings.
        A row with a draft: one per token it outputs (``_after_speculation`` keeps those of the tokens kept)."""
        for seq, row in zip(out.scheduled_seqs, logprobs):
            if row and not seq.is_finished and seq.request.beam is None:   # None: not asked; []: nothing sampled
                if seq.seq_id in out.draft_token_ids:
                    seq.logprobs.extend(row)
                    continue
                seq.logprobs.append(row[0])
                seq.request.fork_logprobs = row[1:]

    def _fork_seq(self, parent: Sequence, sample_index: int) -> Sequence:
        """A new running sequence with the parent's tokens and progress, sharing its blocks."""
        child = Sequence(parent.request, list(parent.token_ids), sample_index)
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RUNNING
        return child

    def _fork(self, request: Request, leader: Sequence, tokens: list[int], now: float) -> None:
        """The prompt is computed: the group becomes n sequences sharing the leader's blocks."""
        request.forked = True
        request.seqs.extend(self._fork_seq(leader, i) for i in range(1, len(tokens)))
        for seq, lp in zip(request.seqs[1:], request.fork_logprobs):
            seq.logprobs = list(leader.logprobs[:-1]) + [lp]
        if leader.grammar is not None:                  # each sibling follows a copy of the leader's matcher
            for seq in request.seqs[1:]:
                seq.grammar = leader.grammar.copy()
        self._intake(request.seqs, [[token] for token in tokens], now)

    def _finish_seq(self, request: Request, seq: Sequence, status: RequestStatus, reason: str | None = None) -> None:
        self._free_seq(seq, status)
        if not request.live_seqs and request.forked:
            self._mark_finished(request, status, reason)
            self._finished.append(request)


def _sampling_rows(out: SchedulerOutput) -> int:
    """The step's rows that output a token (a row part-way through its prompt outputs none)."""
    return sum(1 for k in out.num_samples if k)
