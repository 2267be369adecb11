"""The host -> device contract (``SchedulerOutput``) and the device -> host reply
(``ModelRunnerOutput``). The scheduler owns every sequence's progress (computed tokens, the
placeholders of async scheduling) and states it per row; the runner never changes scheduling
state. It keeps only what it needs to build inputs: each sequence's tokens (from ``new_seqs``,
then from its own sampled results), block table and sampling parameters, and forgets the
finished and preempted."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from jaxengine.sampling_params import SamplingParams


@dataclass
class NewSequenceData:
    """Everything the runner needs about a sequence it has not seen (a new admission, a resume
    after recompute or swap-in, a forked sibling); its progress comes per row
    (``SchedulerOutput.num_computed_tokens``)."""

    seq_id: int
    request_id: str
    token_ids: list[int]           # prompt + output so far (a copy)
    block_table: list[int]         # a copy
    sampling_params: SamplingParams
    sample_index: int              # which of the group's n samples (per-sample seed streams)
    seed: int                      # the request's sampling seed (fixed at creation)
    num_prompt_tokens: int
    # The tokens that end it (EOS unless ignore_eos, stop_token_ids): the sampler masks them
    # until it has ``min_tokens`` output tokens.
    stop_token_ids: tuple[int, ...] = ()
    beam: bool = False             # a beam of a beam search (whose min_tokens keeps the model's scores)
    group_tables: list[list[int]] = field(default_factory=list)   # the other layer groups' tables (copies)
    state_slot: int = 0            # its recurrent layers' state slot (0: the model has none)


@dataclass
class SchedulerOutput:
    # Rows of this step's flat batch, in order (B = len(seq_ids)).
    seq_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)   # B: new tokens per row
    num_samples: list[int] = field(default_factory=list)            # B: 0 mid-prefill, 1, or n at a fork
    # B: tokens in the KV cache before this step (a prefix-cache hit counts as computed).
    num_computed_tokens: list[int] = field(default_factory=list)
    # B: async scheduling: the sample row of the previous step whose token is this row's last
    # input (sampled but still on the device), or -1 when the host knows all the row's tokens.
    previous_sample_rows: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Speculative decoding: seq_id -> the draft tokens its decode row carries after its input token
    # (the row has 1 + len(draft) tokens and samples each of them); rows without a draft are absent.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Speculative decoding: seq_id -> the most draft tokens the runner proposes for the sequence
    # once this step is sampled (for a proposer with a KV cache of its own, the slots of those
    # positions are allocated); they come back in ``ModelRunnerOutput.draft_token_ids``.
    propose: dict[int, int] = field(default_factory=dict)
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    block_tables: dict[int, list[int]] = field(default_factory=dict)  # changed tables of known rows
    group_tables: dict[int, list[list[int]]] = field(default_factory=dict)   # and their other groups' tables
    # Block moves to apply before the step, in this order: swap out, swap in, copy.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)       # (src, dst)
    # Recurrent state moves, applied in this order (a fork's copy reads its parent's state before
    # any slot freed this step is refilled): copy (parent slot, child slot), swap out (device,
    # host), swap in (host, device).
    states_to_copy: list[tuple[int, int]] = field(default_factory=list)
    states_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    states_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Recurrent state snapshots the step takes for the prefix cache: (row, position, slot), the
    # row's state after its token at ``position`` copied into ``slot``.
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)    # forget these
    preempted_seq_ids: list[int] = field(default_factory=list)   # forget these (resent when resumed)
    # Step statistics for traces and metrics.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0      # one per decoding row (its draft tokens counted apart)
    num_draft_tokens: int = 0
    num_preemptions: int = 0
    num_swap_fallbacks: int = 0     # preemptions that meant to swap but recomputed: host pool full
    num_prefix_hit_tokens: int = 0  # prompt tokens that sequences admitted now found in the prefix cache
    # Structured output: [sum(num_samples), ceil(V / 32)] int32, each sample row's allowed tokens
    # (all bits set for rows without a grammar); None when no row of the step has one.
    token_bitmask: object = None
    # Host-side handles for ``Scheduler.update_from_output`` (not for the runner).
    scheduled_seqs: list = field(default_factory=list, repr=False)


class BlockMoves(NamedTuple):
    """A step's block moves (swap out, swap in, copy), each a list of (from, to) block pairs, and
    its recurrent state moves (copy, swap out, swap in: ``SchedulerOutput.states_to_*``): the part
    of a ``SchedulerOutput`` that the device applies before the step."""

    swap_out: list
    swap_in: list
    copy: list
    state_copy: list | tuple = ()
    state_swap_out: list | tuple = ()
    state_swap_in: list | tuple = ()

    def __bool__(self) -> bool:
        return any(self)


NO_MOVES = BlockMoves([], [], [])


class StepLimits(NamedTuple):
    """The most one step may hold: its token budget and its sequences (rows). The configured
    limits, or less while the runner has not yet compiled the buckets for them (or where the
    autopilot chooses less)."""

    max_num_batched_tokens: int
    max_num_seqs: int


class StepKnobs(NamedTuple):
    """How one step admits and treats prompts, where the autopilot chooses it (None: the
    configured value or the step's limits)."""

    long_prefill_token_threshold: int | None = None     # most tokens one prefill gets (0: no cap)
    max_num_partial_prefills: int | None = None
    delay_factor: float | None = None
    max_num_seqs_admitted: int | None = None            # admissions stop at this many sequences


@dataclass
class ModelRunnerOutput:
    # B lists aligned with ``SchedulerOutput.seq_ids``: the row's sampled tokens (empty when the
    # row did not sample, n tokens at a fork; a row with a draft: the accepted drafts, then the
    # target's next token).
    sampled_token_ids: list[list[int]]
    # None, or B entries: None for rows that asked for no logprobs, else per sample
    # (logprob of the sampled token, {token id: logprob} of the top-k).
    logprobs: list | None = None
    # None, or B entries: None, or [(position, {token id: logprob})] for prompt tokens scored.
    prompt_logprobs: list | None = None
    # A mixture of experts: tokens routed to each expert in the step, summed over the layers.
    expert_tokens: tuple[int, ...] = ()
    # Speculative decoding: seq_id -> the draft proposed after this step (``SchedulerOutput.propose``).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
