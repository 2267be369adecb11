"""Requests as the scheduler sees them: a ``Request`` is a sequence group of one or more
``Sequence``s that share a prompt (``n > 1`` is parallel sampling).

A sequence's state is two counters over one token list (prompt + output so far):
``num_tokens`` and ``num_computed_tokens`` (tokens whose KV is in the cache). A prefill
chunk, a whole prompt, a prefix-cache hit and a decode all just move ``num_computed_tokens``.
"""
from __future__ import annotations

import enum
import itertools
import random
import time
from dataclasses import dataclass
from typing import NamedTuple

from jaxengine.lora_request import LoRARequest
from jaxengine.sampling_params import BeamSearchParams, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING_FOR_GRAMMAR = -1   # its structured-output grammar is compiling; not yet in the scheduler
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    PREEMPTED = 3          # preempted by recompute, waiting to resume
    FINISHED_STOPPED = 4   # EOS or a stop token / stop string
    FINISHED_LENGTH = 5    # max_tokens or the model's context length
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7   # can never be scheduled (too long for the model or the pool)
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "error",
    RequestStatus.FINISHED_ERROR: "error",
}

_seq_ids = itertools.count()
PLACEHOLDER = -1        # a token sampled by a step still on the device (async scheduling)


class Sequence:
    """One sample of a group: its tokens, its KV progress and its block table."""

    __slots__ = ("seq_id", "request", "token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "block_table", "group_tables", "state_slot", "pending_snapshots", "block_hashes", "num_cached_blocks", "status", "stop_reason",
                 "sample_index", "is_new", "logprobs", "num_pending", "pending_sample_row",
                 "cumulative_logprob", "grammar", "spec_accepted", "spec_trials")

    def __init__(self, request: "Request", token_ids: list[int], sample_index: int) -> None:
        self.seq_id: int = next(_seq_ids)
        self.request = request
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # The other layer groups' tables (a model with several: ``CacheConfig.group_windows``), each as
        # long as ``block_table``; a windowed group's holds the null block 0 where its window has passed.
        self.group_tables: list[list[int]] = []
        # Recurrent layers' state: its slot in the device's state pool (the host's while swapped
        # out), None while it holds none.
        self.state_slot: int | None = None
        # Snapshots of that state a step takes at block boundaries, (blocks before the boundary,
        # the slot), held until their block's hash is known and they join the prefix cache.
        self.pending_snapshots: list[tuple[int, int]] = []
        self.block_hashes: list[bytes] = []   # chained hashes of the full blocks of token_ids
        self.num_cached_blocks = 0            # leading blocks registered in the prefix cache
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.sample_index = sample_index      # which of the group's n samples (seed streams)
        self.is_new = True                    # the runner has not seen this sequence's state
        self.logprobs: list = []              # per output token, when asked for: (logprob, top-k dict)
        # Async scheduling: trailing PLACEHOLDER tokens sampled by steps still on the device. They
        # count as tokens for scheduling; update_from_output fills them in, oldest first.
        self.num_pending = 0
        self.pending_sample_row = -1          # the latest placeholder's sample row in its step
        self.cumulative_logprob = 0.0         # beam search: of the output tokens
        self.grammar = None                   # structured output: this sequence's matcher
        # Speculative decoding: its draft tokens accepted, and tried (accepted + rejections), decayed.
        self.spec_accepted = 0.0
        self.spec_trials = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_real_tokens(self) -> int:
        """Tokens whose values are known on the host (placeholders excluded)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_real_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_real_tokens - self.num_prompt_tokens

    def drop_pending(self) -> int:
        """Forget the placeholders (their tokens, still on the device, are discarded); returns how many."""
        n = self.num_pending
        if n:
            del self.token_ids[-n:]
            self.num_pending = 0
        return n

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.name})")


@dataclass
class RequestTimes:
    """Per-request timestamps (monotonic seconds) for metrics."""

    queued: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


def prefix_keys(cache_salt: str | None = None, lora_digest: str | None = None) -> tuple:
    """A prompt's first-block extra keys: its cache salt, and its LoRA adapter's content digest
    (by content, not name: an adapter reloaded changed under the same name shares nothing)."""
    keys = () if cache_salt is None else (cache_salt,)
    return keys if lora_digest is None else (*keys, ("lora", lora_digest))


class LatencyTargets(NamedTuple):
    """A request's own latency targets in seconds, for the autopilot (None: the engine's)."""

    ttft_s: float | None = None
    itl_s: float | None = None

    @classmethod
    def from_ms(cls, targets: dict | None) -> "LatencyTargets | None":
        """``{"ttft_ms": ..., "itl_ms": ...}`` (the server's ``slo`` extra); errors name the key."""
        if not targets:
            return None
        unknown = sorted(set(targets) - {"ttft_ms", "itl_ms"})
        if unknown:
            raise ValueError(f"slo: unknown key(s) {unknown}; known: ['itl_ms', 'ttft_ms']")
        for key, value in targets.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"slo.{key}: must be a number > 0 (milliseconds), got {value!r}")
        seconds = {key: None if v is None else v / 1000 for key, v in targets.items()}
        return cls(seconds.get("ttft_ms"), seconds.get("itl_ms"))


class Request:
    """A sequence group: one prompt, ``sampling_params.n`` samples scheduled as one unit.

    Until its prompt is computed the group holds a single leader sequence; the step that
    completes the prompt samples ``n`` tokens and the group forks, the siblings sharing the
    leader's blocks by reference count. A beam search (``BeamSearchParams``) is a group of
    ``beam_width`` beams that fork, extend and drop as the search decides (``beam``, made by
    the scheduler that takes the request); when it ends, ``seqs`` holds its finished
    hypotheses, best first. ``stop_check`` finds stop strings in a beam's output (beam search
    decides stops on the host, where the door that has the tokenizer gives it).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | BeamSearchParams, *, arrival_time: float | None = None,
                 priority: int = 0, eos_token_id: int | None = None, cache_salt: str | None = None,
                 stop_check=None, slo: LatencyTargets | None = None, lora_request: LoRARequest | None = None,
                 lora_adapter=None, lora_digest: str | None = None) -> None:
        """``lora_request``: the adapter it runs with (None: the base model); ``lora_adapter``: its
        weights as read when the request came (the runner's object: the request runs on these
        whatever is loaded or unloaded later), whose content digest is ``lora_digest`` (the prefix
        cache and the scheduler's adapter limit key on it)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        if not all(isinstance(t, int) and t >= 0 for t in prompt_token_ids):
            raise ValueError("prompt_token_ids: must be non-negative integers")
        beam_params = sampling_params if isinstance(sampling_params, BeamSearchParams) else None
        if beam_params is not None:
            sampling_params = beam_params.sampling_params()
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.slo = slo
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_adapter = lora_adapter
        self.lora_digest = lora_digest if lora_adapter is None else lora_adapter.digest
        # Until the scheduler takes it: a request with a constraint first waits for its grammar.
        self.status = (RequestStatus.WAITING if sampling_params.structured_outputs is None
                       else RequestStatus.WAITING_FOR_GRAMMAR)
        self.status_reason: str | None = None
        self.seqs: list[Sequence] = [Sequence(self, list(prompt_token_ids), 0)]
        self.forked = sampling_params.n == 1
        self.num_cached_tokens = 0            # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.fork_logprobs: list = []         # the siblings' first-sample logprobs, handed over at the fork
        # With prompt_logprobs: per prompt position, {token id: logprob} (None for the first token).
        self.prompt_logprobs = None if sampling_params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        self.times = RequestTimes(queued=self.arrival_time)
        self.stop_token_set = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos or eos_token_id is None else {eos_token_id})
        self.max_output_tokens = sampling_params.max_tokens or 1 << 62  # capped by the scheduler
        # Penalties read the whole token history on the host: such requests don't run ahead.
        p = sampling_params
        self.needs_history = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
        self.grammar_future = None            # structured output: its grammar, compiling
        self.beam_params = beam_params
        self.stop_check = stop_check
        self.beam = None                      # the search's state (``core.beam_search.BeamSearch``)
        # Its rows get no placeholder under async scheduling, so they sit out the step run ahead
        # (the others run on): a beam's next token is the search's choice, a grammar's mask
        # needs the previous token.
        self.waits_for_tokens = beam_params is not None or p.structured_outputs is not None
        # Fixed here so a preempted and resumed request continues the same random stream.
        self.seed = sampling_params.seed if sampling_params.seed is not None else random.getrandbits(32)

    @property
    def prefix_keys(self) -> tuple:
        """What its first KV block's hash covers besides the tokens: the cache salt and the
        adapter's content digest (KV computed under one adapter serves no other)."""
        return prefix_keys(self.cache_salt, self.lora_digest)

    # Single-sequence views; an n > 1 group keeps per-sample values on ``seqs``.
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.seqs[0].num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.seqs[0].num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.seqs[0].output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status < RequestStatus.FINISHED_STOPPED]

    @property
    def max_num_running_seqs(self) -> int:
        """Sequences this group may run at once: n before the fork, the live ones after."""
        if not self.forked:
            return self.sampling_params.n
        return sum(1 for s in self.seqs if s.status < RequestStatus.FINISHED_STOPPED)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.name}, seqs={self.seqs})"


SequenceGroup = Request


def check_stop(request: Request, seq: Sequence, token: int) -> RequestStatus | None:
    """The stop checks after ``token`` was appended to ``seq``: EOS / stop tokens (not before
    ``min_tokens``, EOS not with ``ignore_eos``), then ``max_tokens`` and the context length."""
    num_output = seq.num_real_tokens - seq.num_prompt_tokens
    if token in request.stop_token_set and num_output >= request.sampling_params.min_tokens:
        seq.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
