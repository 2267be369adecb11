"""Data parallelism: engine replicas, each on its own devices, behind one engine interface.

Each replica is a whole ``Engine`` (its scheduler, KV cache and runner on its own mesh of
``tensor_parallel_size`` devices). A step launches every replica that has work, runs the
caller's host work once while they all compute, then completes each: the replicas' device work
overlaps. A new request goes to one replica for its whole life (``choose_replica``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence as Seq

from jaxengine.engine import Engine, EngineStats
from jaxengine.request import Request, RequestStatus, Sequence
from jaxengine.sampling_params import SamplingParams
from jaxengine.trace import StepTrace, round_seconds

logger = logging.getLogger(__name__)

MIN_SLACK = 2            # requests: loads this close to the least count as close whatever its size
SLACK_FRACTION = 4       # ... or within a quarter of the least load, when that is more


def closeness_bound(least_load: int) -> int:
    """How far above the least load a replica's load may be and still count as close:
    ``max(2, least_load // 4)`` requests."""
    return max(MIN_SLACK, least_load // SLACK_FRACTION)


def choose_replica(loads: Seq[int], cached_blocks: Callable[[int], int]) -> int:
    """The replica for a new request, from each replica's load (its unfinished requests) and
    ``cached_blocks(i)``, the leading blocks of the prompt replica i's prefix cache holds.

    Among the replicas whose load is within ``closeness_bound`` of the least, the one holding
    the longest cached prefix wins (computing it there again would cost a prefill and cache the
    same blocks twice); with no prefix cached anywhere close, the least loaded; ties go to the
    lower load, then the lower index. A replica further off never wins on its cache: affinity
    must not pile requests on one replica while others idle."""
    least = min(loads)
    close = [i for i, load in enumerate(loads) if load <= least + closeness_bound(least)]
    if len(close) == 1:
        return close[0]
    return max(close, key=lambda i: (cached_blocks(i), -loads[i], -i))


class DataParallelEngine:
    """The interface of ``Engine`` that ``LLM`` and the server use, over ``replicas``.

    Load is a replica's unfinished requests (waiting, running, swapped), not its tokens: how
    long outputs run is unknown until they stop, and a replica steps all its running requests
    together, so their count is the queue a new request joins; it is also O(1) to read.

    Its ``last_trace`` and ``traces`` sum the stepped replicas' records (device idle time too:
    device-seconds); a trace file is written by each replica, with its own records."""

    def __init__(self, replicas: list[Engine], *, trace: bool = False) -> None:
        if not replicas:
            raise ValueError("data_parallel_size: at least one replica is needed")
        self.replicas = replicas
        self.config = replicas[0].config
        self.num_routed = [0] * len(replicas)      # requests sent to each replica
        self.num_steps = 0
        self.traces: list[StepTrace] | None = [] if trace else None
        self.last_trace: StepTrace | None = None   # the latest step, summed over the replicas
        self._failed: Engine | None = None         # the replica whose launch or completion raised
        self._started = time.perf_counter()

    @property
    def clock(self):
        """The replicas' clock (arrival times are read on it)."""
        return self.replicas[0].clock

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    stop_check=None, slo=None, lora_request=None) -> Request:
        """Queue a request on the replica ``route`` picks (the arguments are ``Engine.add_request``'s)."""
        if self._replica_of(request_id) is not None:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        i = self.route(prompt_token_ids, cache_salt)
        request = self.replicas[i].add_request(request_id, prompt_token_ids, sampling_params, priority=priority,
                                               arrival_time=arrival_time, cache_salt=cache_salt,
                                               stop_check=stop_check, slo=slo, lora_request=lora_request)
        self.num_routed[i] += 1
        return request

    def read_adapter(self, lora_request):
        """Each replica reads the adapter (a bad one fails before any request is queued)."""
        return [replica.read_adapter(lora_request) for replica in self.replicas][0]

    def route(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """The replica a request for this prompt would go to now."""
        return choose_replica([r.num_unfinished for r in self.replicas],
                              lambda i: self.replicas[i].cached_prefix_blocks(token_ids, cache_salt))

    def overload_retry_after(self, prompt_token_ids: list[int], slo=None) -> int | None:
        """The overload policy of the replica the request would go to (``Engine.overload_retry_after``)."""
        return self.replicas[self.route(prompt_token_ids)].overload_retry_after(prompt_token_ids, slo)

    def abort(self, request_id: str) -> bool:
        replica = self._replica_of(request_id)
        return replica is not None and replica.abort(request_id)

    def finish_sequence(self, seq: Sequence, status: RequestStatus, stop_reason: int | str | None = None,
                        num_output_tokens: int | None = None) -> None:
        """On the replica holding the sequence's request (none if it already finished)."""
        replica = self._replica_of(seq.request.request_id)
        if replica is not None:
            replica.finish_sequence(seq, status, stop_reason, num_output_tokens)

    def _replica_of(self, request_id: str) -> Engine | None:
        return next((r for r in self.replicas if r.has_request(request_id)), None)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def has_request(self, request_id: str) -> bool:
        return self._replica_of(request_id) is not None

    def running_requests(self) -> list[Request]:
        return [request for r in self.replicas for request in r.running_requests()]

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' totals; KV usage is their mean (every replica has the same pool)."""
        each = [r.stats() for r in self.replicas]
        return EngineStats(sum(s.num_running for s in each), sum(s.num_waiting for s in each),
                           sum(s.num_swapped for s in each), sum(s.kv_usage for s in each) / len(each),
                           sum(s.prefix_cache_queries for s in each), sum(s.prefix_cache_hits for s in each))

    # ---- steps ----
    def step(self, while_running: Callable[[], object] | None = None) -> list[Request]:
        """Launch a step on every replica with work (all of them when none has: an empty step
        tells each runner which sequences finished), run ``while_running`` once while they
        compute, then complete each; returns the requests that finished."""
        start = time.perf_counter()
        active = [r for r in self.replicas if r.has_unfinished_requests()] or self.replicas
        for replica in active:
            self._on(replica, replica.launch)
        if while_running is not None:
            while_running()
        finished: list[Request] = []
        for replica in active:
            finished += self._on(replica, replica.complete)
        self._record(active, start)
        return finished

    def _on(self, replica: Engine, half: Callable[[], object]):
        """Run one half of a replica's step, remembering the replica if it raises."""
        try:
            return half()
        except Exception:
            self._failed = replica
            raise

    def flush(self) -> None:
        for replica in self.replicas:
            replica.flush()

    def flush_trace(self) -> None:
        for replica in self.replicas:
            replica.flush_trace()

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def abandon_failed_step(self) -> list[str]:
        """After ``step()`` raised: the replica that failed abandons its steps (see
        ``Engine.abandon_failed_step``); each other replica completes the step it launched, so
        its requests go on, and abandons it only if that fails too. Returns the ids of the
        requests to abort; raises when a replica cannot go on."""
        failed, self._failed = self._failed, None
        request_ids: list[str] = []
        for replica in self.replicas:
            if replica is failed or not _completes(replica):
                request_ids += replica.abandon_failed_step()
        return request_ids

    def _record(self, stepped: list[Engine], start: float) -> None:
        traces = [r.last_trace for r in stepped]
        s, step_s = self.stats(), time.perf_counter() - start

        def total(name: str):
            return sum(getattr(t, name) for t in traces)

        device_wait_s = sum(t.step_s - t.host_s for t in traces)      # the host waits for each in turn
        self.last_trace = StepTrace(
            step=self.num_steps, time=round_seconds(start - self._started), num_rows=total("num_rows"),
            num_decode_tokens=total("num_decode_tokens"), num_prefill_tokens=total("num_prefill_tokens"),
            num_preemptions=total("num_preemptions"), num_blocks_swapped_in=total("num_blocks_swapped_in"),
            num_blocks_swapped_out=total("num_blocks_swapped_out"), num_swap_fallbacks=total("num_swap_fallbacks"),
            kv_usage=s.kv_usage, num_prefix_hit_tokens=total("num_prefix_hit_tokens"), num_waiting=s.num_waiting,
            num_running=s.num_running, num_swapped=s.num_swapped, step_s=round_seconds(step_s),
            host_s=round_seconds(step_s - device_wait_s), device_idle_s=round_seconds(total("device_idle_s")),
            expert_tokens=_summed_per_index(traces, "expert_tokens"), num_drafts=total("num_drafts"),
            num_draft_tokens=total("num_draft_tokens"),
            num_accepted_tokens=total("num_accepted_tokens"),
            accepted_per_position=_summed_per_index(traces, "accepted_per_position"))
        if self.traces is not None:
            self.traces.append(self.last_trace)
        self.num_steps += 1

def _summed_per_index(traces: list[StepTrace], name: str) -> tuple[int, ...]:
    """A per-index count (each expert's tokens, each draft position's acceptances) summed over
    the replicas; a replica's record without it counts zeros."""
    counts = [getattr(t, name) for t in traces if getattr(t, name)]
    if not counts:
        return ()
    width = max(map(len, counts))
    return tuple(sum(c[i] for c in counts if i < len(c)) for i in range(width))


def _completes(replica: Engine) -> bool:
    """Complete the step a replica launched before another one failed; False if that fails."""
    if not replica.is_launched:
        return True
    try:
        replica.complete()
    except Exception:                                   # noqa: BLE001 - the caller abandons its steps
        logger.exception("a replica failed to complete its step after another replica's failure")
        return False
    return True
