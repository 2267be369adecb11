"""Scheduling policies: the order in which waiting requests are admitted.

A policy is a small object: a ``key`` per waiting request (lower is admitted sooner) and the
queue that keeps requests in that order. Built-ins, by name (``POLICIES``): ``fcfs``,
``priority``, ``shortest-prompt-first``, ``longest-cached-prefix-first``. A user's policy is a
subclass of ``SchedulingPolicy``, given to the engine as the class, an instance, or the string
``"module:Class"`` (``--scheduling-policy mymod:MyPolicy``)::

    class FewestSamplesFirst(SchedulingPolicy):
        name = "fewest-samples-first"

        def key(self, request, kv):
            return (request.sampling_params.n,)

Only the waiting queue's order and the choice of a preemption victim are the policy's: running
groups decode first whatever it says, and a preempted request resumes before any keyed one.
``ranks`` switches on the priority policy's preemption rules, which compare
``Request.priority`` (not the key).
"""
from __future__ import annotations

import heapq
import importlib
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from jaxengine.core.request_queue import FCFSQueue, PriorityQueue
from jaxengine.request import Request

if TYPE_CHECKING:                       # core.kv_cache_manager imports config, which imports this
    from jaxengine.core.kv_cache_manager import KVCacheManager


class SchedulingPolicy:
    """The base class of scheduling policies. Subclass it and define ``key``.

    ``name``: what the policy is called (a subclass that sets none is named after its class).
    ``ranks``: True only for ``priority``: the scheduler then preempts lower-priority running
    groups for a better waiting one, takes swapped and waiting groups in one (priority, arrival)
    order and picks victims by that rank. False: swapped groups come back first, then waiting
    requests in this policy's order; the victim is the last admitted.
    ``dynamic``: the key may change while a request waits (it reads the prefix cache, the
    clock...): it is evaluated anew each time the queue's head is asked for, instead of once
    when the request is queued.

    One instance may serve several schedulers (data-parallel replicas): per-scheduler state
    belongs in the queue ``make_queue`` returns, not on the policy.
    """

    name: str = "custom"
    ranks: bool = False
    dynamic: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def key(self, request: Request, kv: KVCacheManager) -> tuple:
        """The request's place in the waiting queue: lower is admitted sooner. ``kv`` is the
        scheduler's KV cache manager, to be read, not changed (e.g. how much of the prompt the
        prefix cache holds now). Ties are broken by the queue: earlier ``arrival_time``, then
        the order requests were queued in."""
        raise NotImplementedError(f"{type(self).__name__}.key: a SchedulingPolicy must define key()")

    def make_queue(self, kv: KVCacheManager):
        """A new, empty waiting queue for one scheduler (default: a ``KeyedQueue`` on ``key``)."""
        return KeyedQueue(self, kv)

    def rank(self, group: Request) -> tuple:
        """With ``ranks``: the one order of running, swapped and waiting groups (lower first)."""
        return group.priority, group.arrival_time

    def victim(self, running: list[Request]) -> Request:
        """The running group to preempt when blocks run out (``running`` in admission order).
        Not ranking: the last admitted. Ranking: the worst ``rank``, then the last admitted. A
        strict total order, so the best running group is never a victim and always progresses
        (equal groups cannot keep preempting each other)."""
        if not self.ranks:
            return running[-1]
        return running[max(range(len(running)), key=lambda i: (*self.rank(running[i]), i))]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class KeyedQueue:
    """Waiting requests in a policy's key order, with a front lane for preempted requests.

    Invariants: a request ``push_front``-ed (preempted) is served before every keyed one, the
    most recently pushed-front first; keyed requests are served by least
    ``(key, arrival_time, push number)``: a total order, so the result is deterministic. A static
    key is computed once, at ``push``; a dynamic one (``policy.dynamic``) for every waiting
    request at each ``peek``, and ``pop`` takes the request the last ``peek`` returned if the
    queue has not changed since (the scheduler checks the head it then takes, even if the key
    moved in between).
    """

    def __init__(self, policy: SchedulingPolicy, kv: KVCacheManager) -> None:
        self._policy, self._kv = policy, kv
        self._front: deque[Request] = deque()
        self._keyed: dict[Request, int] = {}            # request -> push number
        self._heap: list[tuple] = []                     # static keys: (key, arrival, push number, request)
        self._pushes = itertools.count()
        self._head: Request | None = None                # dynamic: the last peek's answer

    def push(self, request: Request) -> None:
        number = next(self._pushes)
        self._keyed[request] = number
        if not self._policy.dynamic:
            entry = (self._policy.key(request, self._kv), request.arrival_time, number, request)
            heapq.heappush(self._heap, entry)
        self._head = None

    def push_front(self, request: Request) -> None:
        """A preempted request resumes before every keyed one (as ``FCFSQueue.push_front``)."""
        self._front.appendleft(request)
        self._head = None

    def peek(self) -> Request:
        if self._front:
            return self._front[0]
        if not self._keyed:
            raise IndexError("peek from an empty queue")
        if self._policy.dynamic:
            self._head = self._least_dynamic()
            return self._head
        return self._heap[0][3]

    def pop(self) -> Request:
        head, self._head = self._head, None
        if self._front:
            return self._front.popleft()
        if not self._keyed:
            raise IndexError("pop from an empty queue")
        if not self._policy.dynamic:
            request = heapq.heappop(self._heap)[3]
        else:
            request = head if head is not None else self._least_dynamic()
        del self._keyed[request]
        return request

    def remove(self, request: Request) -> None:
        """Take out a request wherever it is; ValueError if it is not queued."""
        if request in self._keyed:
            del self._keyed[request]
            if not self._policy.dynamic:
                self._heap = [e for e in self._heap if e[3] is not request]
                heapq.heapify(self._heap)
            self._head = None
        else:
            self._front.remove(request)

    def _sort_key(self, request: Request) -> tuple:
        return self._policy.key(request, self._kv), request.arrival_time, self._keyed[request]

    def _least_dynamic(self) -> Request:
        return min(self._keyed, key=self._sort_key)

    def __contains__(self, request: Request) -> bool:
        return request in self._keyed or request in self._front

    def __len__(self) -> int:
        return len(self._front) + len(self._keyed)

    def __iter__(self) -> Iterator[Request]:
        """In serving order as of now."""
        yield from list(self._front)
        if self._policy.dynamic:
            yield from sorted(self._keyed, key=self._sort_key)
        else:
            yield from (e[3] for e in sorted(self._heap))


# ---------------------------------------------------------------- built-ins
class FirstComeFirstServed(SchedulingPolicy):
    """Arrival order (the order requests were queued in)."""

    name = "fcfs"

    def key(self, request: Request, kv: KVCacheManager) -> tuple:
        return ()

    def make_queue(self, kv: KVCacheManager) -> FCFSQueue:
        return FCFSQueue()


class Priority(SchedulingPolicy):
    """Lower ``Request.priority`` first, then earlier arrival; may preempt (``ranks``)."""

    name = "priority"
    ranks = True

    def key(self, request: Request, kv: KVCacheManager) -> tuple:
        return (request.priority,)

    def make_queue(self, kv: KVCacheManager) -> PriorityQueue:
        return PriorityQueue()


class ShortestPromptFirst(SchedulingPolicy):
    """Fewer prompt tokens first: short requests are not stuck behind long prefills (a long
    one waits while shorter ones keep arriving)."""

    name = "shortest-prompt-first"

    def key(self, request: Request, kv: KVCacheManager) -> tuple:
        return (request.num_prompt_tokens,)


class LongestCachedPrefixFirst(SchedulingPolicy):
    """More prompt tokens in the prefix cache now first: they cost the least to admit, and
    admitted soon their cached blocks are not evicted first."""

    name = "longest-cached-prefix-first"
    dynamic = True

    def key(self, request: Request, kv: KVCacheManager) -> tuple:
        # The leader's hit, as admission will see it; its block hashes are memoised on the
        # sequence, so each re-evaluation costs only the cache lookups.
        hit = kv.get_computed_blocks(request.seqs[0])
        return (-len(hit.blocks) * kv.block_size,)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (FirstComeFirstServed, Priority, ShortestPromptFirst, LongestCachedPrefixFirst)}


def resolve_policy(spec: str | type[SchedulingPolicy] | SchedulingPolicy,
                   field: str = "scheduling_policy") -> SchedulingPolicy:
    """The policy ``spec`` names: a built-in name, ``"module:Class"`` (imported, instantiated
    with no arguments), a ``SchedulingPolicy`` subclass (instantiated) or an instance (returned
    as is). A bad spec is a ValueError that starts with ``field``."""
    if isinstance(spec, SchedulingPolicy):
        return _checked(spec, field)
    if isinstance(spec, str):
        spec = POLICIES.get(spec) or _import_policy(spec, field)
    if not (isinstance(spec, type) and issubclass(spec, SchedulingPolicy)):
        raise ValueError(f"{field}: {spec!r} is not a SchedulingPolicy subclass")
    try:
        policy = spec()
    except TypeError as e:
        raise ValueError(f"{field}: {spec.__name__} cannot be made with no arguments: {e}") from e
    return _checked(policy, field)


def _checked(policy: SchedulingPolicy, field: str) -> SchedulingPolicy:
    """Refuse at once a policy whose queue would fail on the first request."""
    cls = type(policy)
    if cls.key is SchedulingPolicy.key and cls.make_queue is SchedulingPolicy.make_queue:
        raise ValueError(f"{field}: {cls.__name__} defines neither key() nor make_queue()")
    return policy


def _import_policy(spec: str, field: str) -> object:
    """The attribute ``spec`` = ``"module:Class"`` names."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{field}: must be one of {list(POLICIES)} or 'module:Class' naming a "
                         f"SchedulingPolicy subclass, got {spec!r}")
    try:
        found = importlib.import_module(module_name)
    except Exception as e:                  # not found, or failed while importing: say which
        raise ValueError(f"{field}: cannot import module {module_name!r} of {spec!r}: "
                         f"{type(e).__name__}: {e}") from e
    try:
        for part in attr.split("."):        # a nested class: module:Outer.Inner
            found = getattr(found, part)
    except AttributeError:
        raise ValueError(f"{field}: module {module_name!r} has no attribute {attr!r}") from None
    return found
