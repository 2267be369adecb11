"""Scheduling policies: the built-ins' admission orders, the keyed queue's invariants, user
policies given as a class, an instance or "module:Class", and bad specs named at config time.
Block size 4 (tests.helpers.SMALL); {request: tokens} per step."""
import pytest

from jaxengine import SchedulingPolicy
from jaxengine.config import CacheConfig, SchedulerConfig
from jaxengine.core.kv_cache_manager import KVCacheManager
from jaxengine.core.policy import (POLICIES, KeyedQueue, LongestCachedPrefixFirst, ShortestPromptFirst,
                                   resolve_policy)
from jaxengine.core.request_queue import FCFSQueue, PriorityQueue
from jaxengine.core.scheduler import Scheduler
from jaxengine.request import Request, RequestStatus
from jaxengine.sampling_params import SamplingParams

from tests.helpers import Harness

BUILT_INS = ["fcfs", "priority", "shortest-prompt-first", "longest-cached-prefix-first"]


class LatestFirst(SchedulingPolicy):
    """A user's policy: the latest arrival first."""

    name = "latest-first"

    def key(self, request, kv):
        return (-request.arrival_time,)


USER_MODULE = '''
from jaxengine import SchedulingPolicy


class LatestFirst(SchedulingPolicy):
    name = "latest-first"

    def key(self, request, kv):
        return (-request.arrival_time,)
'''


def admission_order(h: Harness) -> list[str]:
    """Run to the end; the request ids in the order they were first scheduled."""
    order: list[str] = []
    while h.scheduler.has_unfinished_requests():
        order += [rid for rid in h.step() if rid not in order]
    return order


def add_scripted_queue(h: Harness) -> None:
    """(id, prompt tokens, priority), arriving in this order."""
    for arrival, (rid, tokens, priority) in enumerate([("A", 12, 2), ("B", 4, 0), ("C", 8, 1), ("D", 4, 1)]):
        h.add(rid, tokens, max_tokens=2, priority=priority, arrival=float(arrival))


def test_the_built_ins_are_registered_by_name():
    assert list(POLICIES) == BUILT_INS
    assert [resolve_policy(name).name for name in BUILT_INS] == BUILT_INS
    assert [resolve_policy(name).ranks for name in BUILT_INS] == [False, True, False, False]
    assert [resolve_policy(name).dynamic for name in BUILT_INS] == [False, False, False, True]


@pytest.mark.parametrize("policy, queue_type", [("fcfs", FCFSQueue), ("priority", PriorityQueue),
                                                ("shortest-prompt-first", KeyedQueue),
                                                ("longest-cached-prefix-first", KeyedQueue)])
def test_the_scheduler_resolves_its_policy_once_and_builds_its_queue(policy, queue_type):
    scheduler = Harness(policy=policy).scheduler
    assert scheduler.policy.name == policy and type(scheduler.waiting) is queue_type


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["A", "B", "C", "D"]),                          # arrival
    ("priority", ["B", "C", "D", "A"]),                      # priority 0, 1, 1 (by arrival), 2
    ("shortest-prompt-first", ["B", "D", "C", "A"]),         # 4, 4 (by arrival), 8, 12 tokens
    ("longest-cached-prefix-first", ["A", "B", "C", "D"]),   # nothing cached: arrival
])
def test_each_built_in_admits_a_scripted_queue_in_its_order(policy, expected):
    h = Harness(max_num_seqs=1, policy=policy)               # one at a time: admission order shows
    add_scripted_queue(h)
    assert admission_order(h) == expected


@pytest.mark.parametrize("policy, first_steps", [
    ("fcfs", [{"long": 14}, {"long": 1, "short": 6}]),       # short (6) does not fit the 2 left
    ("shortest-prompt-first", [{"short": 6}, {"short": 1, "long": 14}]),
])
def test_shortest_prompt_first_admits_the_short_prompt_first_under_a_budget_that_fits_one(policy, first_steps):
    h = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False, policy=policy)
    h.add("long", 14, max_tokens=4, arrival=0.0)
    h.add("short", 6, max_tokens=4, arrival=1.0)
    assert [h.step() for _ in first_steps] == first_steps


SHARED = list(range(1, 13))                                  # 3 blocks


@pytest.mark.parametrize("policy, admitted, hit_tokens", [
    ("fcfs", {"cold": 16}, 0),
    ("longest-cached-prefix-first", {"hot": 4}, 12),         # 3 of its 4 blocks were cached
])
def test_longest_cached_prefix_first_prefers_the_prefix_a_finished_request_just_cached(policy, admitted, hit_tokens):
    """warm, cold and hot queue while nothing is cached; warm runs alone (max_num_seqs=1) and
    caches SHARED. When warm finishes, hot's key has changed since it was queued."""
    h = Harness(max_num_seqs=1, enable_prefix_caching=True, policy=policy)
    h.add("warm", SHARED + [13, 14, 15, 16], max_tokens=2, arrival=0.0)
    h.add("cold", list(range(50, 66)), max_tokens=2, arrival=1.0)
    h.add("hot", SHARED + [90, 91, 92, 93], max_tokens=2, arrival=2.0)
    assert h.step() == {"warm": 16}
    assert h.step() == {"warm": 1}
    assert h.requests["warm"].status is RequestStatus.FINISHED_LENGTH
    assert h.step() == admitted and h.last.num_prefix_hit_tokens == hit_tokens


@pytest.mark.parametrize("policy", ["shortest-prompt-first", LatestFirst])
def test_a_preempted_request_resumes_before_keyed_ones(policy):
    """r2 (4-token prompt) is preempted by recompute while tiny (2 tokens, arrived later) waits:
    both policies here rank tiny first, yet r2 comes back first."""
    h = Harness(num_gpu_blocks=7, max_num_seqs=3, policy=policy)    # 6 usable blocks
    for rid in ("r0", "r1", "r2"):
        h.add(rid, 4, max_tokens=8, arrival=0.0)
    h.step()
    h.step()
    h.add("tiny", 2, max_tokens=2, arrival=1.0)                    # max_num_seqs holds it back
    for _ in range(3):
        assert h.step() == {"r0": 1, "r1": 1, "r2": 1}
    assert h.step() == {"r0": 1, "r1": 1}                          # position 8: a third block each
    assert h.last.num_preemptions == 1 and h.requests["r2"].status is RequestStatus.PREEMPTED
    assert list(h.scheduler.waiting) == [h.requests["r2"], h.requests["tiny"]]
    while "r2" not in h.step():
        pass
    assert scheduled_ids(h) == ["r2", "tiny"]
    assert h.last.num_scheduled_tokens == [9, 2]                   # prompt + 5 kept outputs, recomputed


def scheduled_ids(h: Harness) -> list[str]:
    return [s.request.request_id for s in h.last.scheduled_seqs]


# ---------------------------------------------------------------- the keyed queue
def make_request(rid: str, num_tokens: int, arrival: float) -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1), arrival_time=arrival)


def kv_manager() -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=4, num_gpu_blocks=8))


@pytest.mark.parametrize("policy, expected", [
    (ShortestPromptFirst(), ["first", "second", "late", "long"]),   # 4 tokens (arrival 1, 1, 2), 8
    (LongestCachedPrefixFirst(), ["long", "first", "second", "late"]),   # nothing cached: arrival, push
])
def test_keyed_queue_breaks_ties_by_arrival_then_push_order(policy, expected):
    q = KeyedQueue(policy, kv_manager())
    requests = [make_request("late", 4, 2.0), make_request("first", 4, 1.0), make_request("second", 4, 1.0),
                make_request("long", 8, 0.0)]
    for r in requests:
        q.push(r)
    assert len(q) == 4 and all(r in q for r in requests)
    assert [r.request_id for r in q] == expected
    assert [q.pop().request_id for _ in requests] == expected
    assert len(q) == 0 and requests[0] not in q


def test_keyed_queue_serves_pushed_front_requests_first_most_recent_first():
    q = KeyedQueue(ShortestPromptFirst(), kv_manager())
    short, long_, p1, p2 = (make_request("short", 2, 5.0), make_request("long", 8, 0.0),
                            make_request("p1", 9, 0.0), make_request("p2", 9, 0.0))
    q.push(long_)
    q.push_front(p1)
    q.push(short)
    q.push_front(p2)
    assert [r.request_id for r in q] == ["p2", "p1", "short", "long"]
    assert q.peek() is p2
    q.remove(p1)
    q.remove(long_)
    assert [q.pop().request_id for _ in range(len(q))] == ["p2", "short"]
    with pytest.raises(IndexError):
        q.peek()
    with pytest.raises(ValueError):
        q.remove(long_)


class ByTable(SchedulingPolicy):
    """A dynamic key read from a table the test changes."""

    dynamic = True

    def __init__(self) -> None:
        self.table: dict[str, int] = {}

    def key(self, request, kv):
        return (self.table[request.request_id],)


def test_a_dynamic_key_is_taken_at_each_peek_and_pop_takes_what_the_last_peek_showed():
    policy = ByTable()
    q = KeyedQueue(policy, kv_manager())
    a, b = make_request("a", 4, 0.0), make_request("b", 4, 1.0)
    policy.table.update(a=1, b=2)
    q.push(a)
    q.push(b)
    assert q.peek() is a
    policy.table.update(a=3)
    assert q.pop() is a                      # what the scheduler checked is what it takes
    q.push(a)
    assert q.peek() is b                     # the key now: b (2) before a (3)
    policy.table.update(b=4)
    assert q.peek() is a and [r.request_id for r in q] == ["a", "b"]
    q.push(make_request("c", 4, 2.0))        # a change: pop evaluates the keys again
    policy.table.update(c=0)
    assert q.pop().request_id == "c"


def test_the_fcfs_and_priority_queues_are_the_existing_ones():
    kv = kv_manager()
    assert type(resolve_policy("fcfs").make_queue(kv)) is FCFSQueue
    assert type(resolve_policy("priority").make_queue(kv)) is PriorityQueue


# ---------------------------------------------------------------- user policies
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module on sys.path that defines LatestFirst; returns its name."""
    (tmp_path / "user_policy_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "user_policy_mod", raising=False)
    return "user_policy_mod"


@pytest.mark.parametrize("form", ["class", "instance", "module:Class"])
def test_a_user_policy_is_used_by_the_scheduler(form, user_module):
    spec = {"class": LatestFirst, "instance": LatestFirst(), "module:Class": f"{user_module}:LatestFirst"}[form]
    h = Harness(max_num_seqs=1, policy=spec)
    assert h.config.scheduler.policy is spec
    policy = h.scheduler.policy
    assert (type(policy).__name__, policy.name, policy.ranks, policy.dynamic) == ("LatestFirst", "latest-first",
                                                                                  False, False)
    assert type(h.scheduler.waiting) is KeyedQueue
    if form == "instance":
        assert policy is spec
    add_scripted_queue(h)
    assert admission_order(h) == ["D", "C", "B", "A"]


def test_a_subclass_without_a_name_is_named_after_its_class():
    class Unnamed(SchedulingPolicy):
        def key(self, request, kv):
            return ()

    assert Unnamed.name == "Unnamed" and resolve_policy(Unnamed).name == "Unnamed"


class NeedsArguments(SchedulingPolicy):
    def __init__(self, weight: float) -> None:
        self.weight = weight

    def key(self, request, kv):
        return (self.weight,)


BUILT_IN_LIST = r"\['fcfs', 'priority', 'shortest-prompt-first', 'longest-cached-prefix-first'\]"


@pytest.mark.parametrize("spec, message", [
    ("lifo", rf"must be one of {BUILT_IN_LIST} or 'module:Class' naming a SchedulingPolicy subclass, got 'lifo'"),
    ("user_policy_mod:", "must be one of"),
    ("no_such_module_here:Policy", r"cannot import module 'no_such_module_here' of 'no_such_module_here:Policy': "
                                   r"ModuleNotFoundError"),
    ("broken_policy_mod:Policy", r"cannot import module 'broken_policy_mod' of 'broken_policy_mod:Policy': "
                                 r"RuntimeError: broken at import"),
    ("user_policy_mod:Nope", "module 'user_policy_mod' has no attribute 'Nope'"),
    ("jaxengine.core.policy:resolve_policy", "<function resolve_policy at .*> is not a SchedulingPolicy subclass"),
    (dict, "<class 'dict'> is not a SchedulingPolicy subclass"),
    (42, "42 is not a SchedulingPolicy subclass"),
    (SchedulingPolicy, "SchedulingPolicy defines neither key"),
    (NeedsArguments, "NeedsArguments cannot be made with no arguments"),
])
def test_a_bad_spec_is_a_value_error_naming_the_field(spec, message, user_module, tmp_path):
    (tmp_path / "broken_policy_mod.py").write_text("raise RuntimeError('broken at import')\n")
    with pytest.raises(ValueError, match=f"^scheduling_policy: {message}"):
        resolve_policy(spec)
    with pytest.raises(ValueError, match=f"^policy: {message}"):
        Scheduler(SchedulerConfig(policy=spec), CacheConfig())      # the config only carries the spec


def test_a_valid_spec_is_carried_unchanged_and_made_by_the_scheduler():
    for spec in [*BUILT_INS, LatestFirst, LatestFirst(), "tests.core.test_policy:LatestFirst"]:
        config = SchedulerConfig(policy=spec)
        assert config.policy is spec
        assert isinstance(Scheduler(config, CacheConfig()).policy, SchedulingPolicy)
