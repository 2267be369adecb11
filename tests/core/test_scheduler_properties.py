"""Property-based tests over random workloads and configurations, thousands of steps in all.

After every step: the budget and max_num_seqs hold, ref counts equal the number of block
tables holding each block, free + used = pool, partial prefills stay under their bound. At the
end every request has finished and every block is free. With the KV-simulating runner, output
tokens are identical whatever the budget, pool, preemption mode, policy (every built-in),
prefix caching or async scheduling (steps launched before the previous step's tokens are
known), beam searches
included: their groups fork, drop and finish without a leaked block, and no step ever writes
a block another sequence holds (copy-on-write). Under the
priority policy nothing that comes back from preemption overtakes a better queued request, and
the best request never waits through a step in which nothing else runs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxengine.core.kv_cache_manager import HOST_NULL, NULL_BLOCK, cdiv
from jaxengine.config import LoRAConfig
from jaxengine.core.policy import POLICIES
from jaxengine.lora_request import LoRARequest
from jaxengine.request import Request, RequestStatus
from jaxengine.sampling_params import BeamSearchParams, SamplingParams

from tests.helpers import Harness

VOCAB = 40          # small, so EOS (token 0) and shared prefixes happen
MAX_STEPS = 5000


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    priority: int
    arrival_step: int
    min_tokens: int
    ignore_eos: bool
    abort_step: int | None
    beam: int = 0                       # a beam search of this width (n unused)
    early_stopping: bool | str = False
    adapter: int | None = None          # its LoRA adapter's id (None: the base model)


BASES = [tuple(range(1, 30)), tuple(range(30, 1, -1))]   # shared prefixes for the prefix cache


@st.composite
def specs(draw, with_aborts: bool):
    out = []
    for i in range(draw(st.integers(1, 10))):
        base = draw(st.sampled_from(BASES))
        prefix_len = draw(st.integers(0, 16))
        suffix = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1 if prefix_len == 0 else 0, max_size=12))
        max_tokens = draw(st.integers(1, 16))
        out.append(Spec(
            request_id=f"r{i}", prompt=base[:prefix_len] + tuple(suffix), max_tokens=max_tokens,
            n=draw(st.sampled_from([1, 1, 1, 2, 3])), priority=draw(st.integers(0, 2)),
            arrival_step=draw(st.integers(0, 12)), min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            abort_step=draw(st.none() | st.integers(0, 40)) if with_aborts else None,
            beam=draw(st.sampled_from([0, 0, 0, 1, 2, 3])), early_stopping=draw(st.sampled_from([False, True, "never"]))))
    return out


def pool_need(spec: Spec, block_size: int) -> int:
    """Blocks the group could ever hold at once with nothing shared."""
    return max(spec.n, spec.beam) * cdiv(len(spec.prompt) + spec.max_tokens, block_size)


@st.composite
def configs(draw, workload: list[Spec]):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(3, 6))     # >= the largest group
    chunked = draw(st.booleans())
    longest = max(len(s.prompt) + s.max_tokens for s in workload)
    budget_floor = max_num_seqs if chunked else max(max_num_seqs, longest)
    return dict(
        block_size=block_size,
        num_gpu_blocks=1 + max(pool_need(s, block_size) for s in workload) + draw(st.integers(0, 24)),
        num_cpu_blocks=draw(st.sampled_from([0, 8, 256])),
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        enable_prefix_caching=draw(st.booleans()),
        max_num_batched_tokens=draw(st.integers(budget_floor, budget_floor + 40)),
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 1, 3, 8])),
        max_num_partial_prefills=draw(st.integers(1, 3)),
        policy=draw(st.sampled_from(list(POLICIES))),     # every built-in
        preemption_mode=draw(st.sampled_from(["auto", "recompute", "swap"])),
        async_scheduling=draw(st.booleans()),
    )


def run_workload(workload: list[Spec], config: dict, check: bool = True, observe=None,
                 make_harness=Harness) -> Harness:
    """``observe(h, step)`` runs after every step; ``make_harness(**config)`` builds the engine."""
    h = make_harness(**config)
    h.runner.vocab_size = VOCAB
    if check:
        forbid_shared_writes(h)
    pending = sorted(workload, key=lambda s: s.arrival_step)
    for step in range(MAX_STEPS):
        h.clock.now = float(step)
        while pending and pending[0].arrival_step <= step:
            add(h, pending.pop(0))
        for spec in workload:
            if spec.abort_step == step:
                h.scheduler.abort(spec.request_id)
        if not pending and not h.scheduler.has_unfinished_requests():
            break
        h.step()
        if check:
            check_invariants(h)
        if observe is not None:
            observe(h, step)
    else:
        raise AssertionError(f"not finished after {MAX_STEPS} steps")
    return h


def forbid_shared_writes(h: Harness) -> None:
    """The runner fails a step that writes KV into a block another sequence holds (a missed or
    wrong copy-on-write): every written block has exactly one holder when the step runs."""
    write = h.runner._write

    def checked(seq_id: int, start: int, n: int) -> None:
        table, bs = h.runner.tables[seq_id], h.runner.block_size
        for block in {table[pos // bs] for pos in range(start, start + n)}:
            assert h.kv.pool.ref_cnt[block] == 1, f"sequence {seq_id} writes block {block}, which others hold"
        write(seq_id, start, n)

    h.runner._write = checked


def add(h: Harness, spec: Spec) -> None:
    params = SamplingParams(max_tokens=spec.max_tokens, n=spec.n, min_tokens=spec.min_tokens,
                            ignore_eos=spec.ignore_eos)
    if spec.beam:
        params = BeamSearchParams(beam_width=spec.beam, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos,
                                  early_stopping=spec.early_stopping, length_penalty=spec.priority - 0.5)
    lora = None if spec.adapter is None else LoRARequest(f"adapter-{spec.adapter}", spec.adapter, "unread")
    request = Request(spec.request_id, list(spec.prompt), params, arrival_time=h.clock(),
                      priority=spec.priority, eos_token_id=0, lora_request=lora,
                      lora_digest=None if lora is None else f"digest-{spec.adapter}")
    h.requests[spec.request_id] = request
    h.scheduler.add_request(request)


def check_invariants(h: Harness) -> None:
    s, kv, cfg = h.scheduler, h.kv, h.config.scheduler
    out = h.last
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.seq_ids) <= cfg.max_num_seqs and min(out.num_scheduled_tokens, default=1) >= 1
    assert sum(g.max_num_running_seqs for g in s.running) <= cfg.max_num_seqs
    assert len(h.runner.tokens) <= cfg.max_num_seqs        # sequences the runner holds state for
    assert sum(Scheduler_is_partial(g) for g in s.running) <= cfg.max_num_partial_prefills
    device, host = Counter(), Counter()
    for g in s.running:
        assert g.status is RequestStatus.RUNNING
        for seq in g.live_seqs:
            device.update(held_blocks(kv, seq, NULL_BLOCK))
            assert len(seq.block_table) * kv.block_size >= seq.num_computed_tokens
    for g in s.swapped:
        for seq in g.live_seqs:
            host.update(held_blocks(kv, seq, HOST_NULL))
    for g in s.waiting:
        assert all(not seq.block_table and not seq.group_tables and seq.num_computed_tokens == 0
                   for seq in g.live_seqs)
    check_windows(h)
    pool = kv.pool
    assert pool.ref_cnt[0] == 1 and 0 not in device
    for b in range(1, pool.num_blocks):
        assert pool.ref_cnt[b] == device[b], f"block {b}"
        assert (b in pool.free_queue) == (device[b] == 0)
    assert len(pool.free_queue) + len(device) == pool.num_usable_blocks
    for b in range(kv.host_pool.num_blocks):
        assert kv.host_pool.ref_cnt[b] == host[b]
    assert all(pool.block_hash[b] == h_ for h_, b in pool.cached_block.items())
    check_state_slots(h)


def check_state_slots(h: Harness) -> None:
    """Each running sequence holds its own device state slot, each swapped one its own host slot,
    nobody else any, and the pools' counts agree."""
    kv, s = h.kv, h.scheduler
    if kv.state_pool is None:
        return
    device = [seq.state_slot for g in s.running for seq in g.live_seqs]
    host = [seq.state_slot for g in s.swapped for seq in g.live_seqs]
    assert None not in device and 0 not in device
    snapshots = [slot for g in s.running for seq in g.live_seqs for _, slot in seq.pending_snapshots]
    device += snapshots                                   # snapshots taken, not cached yet
    assert len(set(device)) == len(device)
    assert None not in host and len(set(host)) == len(host)
    assert all(seq.state_slot is None for g in s.waiting for seq in g.live_seqs)
    assert kv.state_pool.num_free_blocks == kv.state_pool.num_usable_blocks - len(device)
    assert kv.host_state_pool.num_free_blocks == kv.host_state_pool.num_blocks - len(host)


def held_blocks(kv, seq, null: int) -> list[int]:
    """The blocks a sequence holds in every group. Every table is as long as group 0's, and a null
    entry appears only in a windowed group's, before all its blocks."""
    tables = [seq.block_table, *seq.group_tables]
    assert len(tables) == kv.num_groups or (not seq.block_table and not seq.group_tables)
    held = []
    for window, table in zip(kv.group_windows, tables):
        assert len(table) == len(seq.block_table)
        nulls = table.count(null)
        assert nulls == 0 or (window is not None and table[:nulls] == [null] * nulls), table
        held += table[nulls:]
    return held


def check_windows(h: Harness) -> None:
    """Each sequence the step scheduled holds, in each windowed group, exactly the blocks from the
    first its row's first token attends to (under its window) to its last: none its windows have
    passed (slid back to the pool) and none missing."""
    kv, out = h.kv, h.last
    for seq, computed in zip(out.scheduled_seqs, out.num_computed_tokens):
        if seq.status is not RequestStatus.RUNNING:
            continue
        for window, table in zip(kv.group_windows, [seq.block_table, *seq.group_tables]):
            first = 0 if window is None else max(0, computed - window + 1) // kv.block_size
            assert table.count(NULL_BLOCK) == first, (window, computed, table)


def Scheduler_is_partial(group) -> bool:
    return any(len(s.token_ids) - s.num_computed_tokens > 1 for s in group.live_seqs)


def assert_all_released(h: Harness) -> None:
    assert not h.scheduler.has_unfinished_requests()
    assert all(r.is_finished for r in h.requests.values())
    assert h.kv.num_free_blocks == h.kv.num_usable_blocks
    assert h.kv.host_pool.num_free_blocks == h.kv.host_pool.num_blocks
    assert not h.scheduler.running and not h.scheduler.swapped and not len(h.scheduler.waiting)


REFERENCE = dict(block_size=4, num_gpu_blocks=4096, num_cpu_blocks=0, max_num_batched_tokens=4096,
                 max_num_seqs=64, enable_prefix_caching=False, max_model_len=256)

SETTINGS = settings(max_examples=int(__import__("os").environ.get("PROPERTY_EXAMPLES", 400)), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_invariants_hold_every_step_and_everything_is_released(data):
    workload = data.draw(specs(with_aborts=True))
    h = run_workload(workload, data.draw(configs(workload)))
    assert_all_released(h)
    for spec in workload:
        r = h.requests[spec.request_id]
        assert r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                            RequestStatus.FINISHED_ABORTED), (r.status, r.status_reason)


@SETTINGS
@given(st.data())
def test_outputs_do_not_depend_on_scheduling(data):
    workload = data.draw(specs(with_aborts=False))
    expected = run_workload(workload, REFERENCE, check=False).outputs()
    config = data.draw(configs(workload))
    h = run_workload(workload, config)
    assert h.outputs() == expected
    assert_all_released(h)
    assert all(r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
               for r in h.requests.values())


# Layer groups as models have them: full attention beside one window (gpt-oss's shape) or two,
# every layer sliding (Mistral's), and a windowed group 0 beside a full one.
GROUP_WINDOWS = [(None, 3), (None, 5, 5), (6,), (None, 2, 9), (4, None)]


@SETTINGS
@given(st.data())
def test_windowed_groups_hold_only_what_their_windows_reach_and_change_no_output(data):
    """With several layer groups, some sliding: the pool's accounting is exact at every step, each
    scheduled sequence holds in a windowed group exactly the blocks its window reaches
    (``check_windows``), a window never reads a block given back and written over (the runner's
    check), and the tokens are those of one full-attention group."""
    workload = data.draw(specs(with_aborts=True))
    windows = data.draw(st.sampled_from(GROUP_WINDOWS))
    config = data.draw(configs(workload))
    # Room for every group's blocks of the largest group (a window holds at most all of a sequence's).
    config["num_gpu_blocks"] = 1 + (config["num_gpu_blocks"] - 1) * len(windows)
    h = run_workload(workload, {**config, "group_windows": windows})
    expected = run_workload(workload, REFERENCE, check=False).outputs()
    assert {r: o for r, o in h.outputs().items() if h.requests[r].status is not RequestStatus.FINISHED_ABORTED} == \
        {r: o for r, o in expected.items() if h.requests[r].status is not RequestStatus.FINISHED_ABORTED}
    assert_all_released(h)


@SETTINGS
@given(st.data())
def test_recurrent_state_slots_follow_their_sequences_and_change_no_output(data):
    """A model with recurrent layers: every sequence that holds blocks holds a state slot, which
    follows it through chunked prefill, preemption by recompute (afresh from token 0), swapping
    (to a host slot and back), forks of n > 1 and beams (copied into the child's), async
    scheduling and aborts; with prefix caching, snapshots at block boundaries give hits that copy
    them into the new sequence's slot; the runner finds in each row's slot the state of exactly the
    tokens before it, and the tokens are those of a model without one."""
    workload = data.draw(specs(with_aborts=True))
    config = data.draw(configs(workload))
    # a step's sequences, a beam search's forks among them, and room for snapshots
    slots = 2 * config["max_num_seqs"] + 1 + data.draw(st.sampled_from([0, 3, 16]))
    interval = config["block_size"] * data.draw(st.sampled_from([1, 2]))
    h = run_workload(workload, {**config, "num_state_slots": slots, "state_snapshot_interval": interval,
                                "num_cpu_state_slots": data.draw(st.sampled_from([0, 2, 64]))})
    expected = run_workload(workload, REFERENCE, check=False).outputs()
    kept = [r for r in h.requests if h.requests[r].status is not RequestStatus.FINISHED_ABORTED]
    assert {r: h.outputs()[r] for r in kept} == {r: expected[r] for r in kept}
    assert_all_released(h)
    assert h.kv.state_pool.num_free_blocks == slots - 1


def test_a_beam_swapped_out_while_its_step_ran_starts_again_when_its_state_holds_the_position():
    """Found by the search above: a beam search swapped out by the step run ahead while its own
    step ran drops that step's token and, with KV alone, computes the position again once back;
    a recurrent state has consumed the position already, so the group starts again from token 0."""
    spec = dict(priority=0, arrival_step=0, min_tokens=0, ignore_eos=False, abort_step=None)
    workload = [Spec("r0", (1,), 3, 1, **spec), Spec("r1", (1,), 2, 1, beam=2, **spec)] + \
        [Spec(f"r{i}", (1,), 1, 1, **spec) for i in range(2, 8)]
    config = dict(block_size=1, num_gpu_blocks=7, num_cpu_blocks=8, watermark=0.0, enable_prefix_caching=False,
                  max_num_batched_tokens=4, max_num_seqs=3, max_model_len=256, enable_chunked_prefill=False,
                  long_prefill_token_threshold=0, max_num_partial_prefills=1, policy="fcfs",
                  preemption_mode="auto", async_scheduling=True, num_state_slots=7, num_cpu_state_slots=2)
    h = run_workload(workload, config)
    assert h.outputs() == run_workload(workload, REFERENCE, check=False).outputs()
    assert h.requests["r1"].num_preemptions >= 1
    assert_all_released(h)


def test_equal_priority_prefills_do_not_preempt_each_other_forever():
    """Found by the search above: two equal-priority requests, both mid-prefill on a pool that
    holds one of them, used to pick themselves as victims in turn and never finish."""
    prefix = tuple(range(1, 12))
    workload = [Spec("a", prefix + (1, 1, 1), 8, 1, 1, 6, 0, False, None),
                Spec("b", prefix + (12,) + (1,) * 7, 7, 1, 1, 6, 2, False, None),
                Spec("c", (1, 2, 3), 2, 1, 0, 0, 0, False, None)]
    config = dict(block_size=1, num_gpu_blocks=29, num_cpu_blocks=8, watermark=0.0, enable_prefix_caching=False,
                  max_num_batched_tokens=12, max_num_seqs=4, max_model_len=256, enable_chunked_prefill=True,
                  long_prefill_token_threshold=8, max_num_partial_prefills=3, policy="priority",
                  preemption_mode="swap")
    h = run_workload(workload, config)
    assert h.outputs() == run_workload(workload, REFERENCE, check=False).outputs()
    assert sum(r.num_preemptions for r in h.requests.values()) <= 4


def test_async_scheduling_runs_ahead_and_changes_nothing():
    """Aborts, EOS, preemption by swap and recompute while a step is in flight; same outputs."""
    workload = [Spec(f"r{i}", tuple(range(1 + i, 12 + i)), 10 + i, 1 + (i % 3 == 0), i % 2, i, 0, i % 2 == 0,
                     9 if i == 4 else None) for i in range(8)]
    config = dict(block_size=2, num_gpu_blocks=40, num_cpu_blocks=16, watermark=0.0, enable_prefix_caching=True,
                  max_num_batched_tokens=16, max_num_seqs=6, max_model_len=256, enable_chunked_prefill=True,
                  long_prefill_token_threshold=0, max_num_partial_prefills=2, policy="fcfs",
                  preemption_mode="auto")
    sync = run_workload(workload, config)
    fast = run_workload(workload, {**config, "async_scheduling": True})
    assert fast.outputs() == sync.outputs()
    assert fast.engine.num_run_ahead > 0.5 * fast.engine.num_steps
    assert sum(r.num_preemptions for r in fast.requests.values()) > 0
    assert fast.requests["r4"].status is RequestStatus.FINISHED_ABORTED
    assert_all_released(fast)


@st.composite
def priority_workloads(draw):
    """Lower-priority traffic with at least one n > 1 group, and one request of the best
    priority arriving while it runs."""
    traffic = [replace(s, priority=s.priority + 1) for s in draw(specs(with_aborts=False))]
    traffic[0] = replace(traffic[0], n=draw(st.sampled_from([2, 3])), arrival_step=0)
    vip = replace(draw(specs(with_aborts=False))[0], request_id="vip", priority=0,
                  arrival_step=draw(st.integers(1, 12)))
    return traffic + [vip]


class RankWatch:
    """After each step: no group came back (swapped in or recomputed) while a strictly better
    request still waits; counts the steps after which the best request ("vip") waits while no
    other group runs (the device would idle for it)."""

    def __init__(self) -> None:
        self.status: dict[str, RequestStatus] = {}
        self.vip_idle_steps = 0

    def __call__(self, h: Harness, step: int) -> None:
        requests = h.requests.values()
        rank = {r.request_id: (r.priority, r.arrival_time) for r in requests}
        back = [r for r in requests if r.status is RequestStatus.RUNNING
                and self.status.get(r.request_id) in (RequestStatus.SWAPPED, RequestStatus.PREEMPTED)]
        queued = [r for r in requests if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                                      RequestStatus.SWAPPED)]
        for r in back:
            better = [q.request_id for q in queued if rank[q.request_id] < rank[r.request_id]]
            assert not better, f"step {step}: {r.request_id} came back before {better}"
        self.status = {r.request_id: r.status for r in requests}
        vip = h.requests.get("vip")
        if vip is not None and vip.status is RequestStatus.WAITING and not h.scheduler.running:
            self.vip_idle_steps += 1


@settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 4))    # slower examples: tight pools
@given(st.data())
def test_priority_groups_come_back_in_rank_order_and_the_best_request_never_waits_on_an_idle_device(data):
    """Random priority traffic with n > 1 groups (swapped or recomputed) on a tight pool, and one
    request of the best priority: nothing that comes back overtakes a better request, and the
    best request waits only while others run, never through idle steps (but the one that
    preempted for it, and with async scheduling the one already in flight)."""
    workload = data.draw(priority_workloads())
    config = {**data.draw(configs(workload)), "policy": "priority"}
    config["num_gpu_blocks"] = 1 + max(pool_need(s, config["block_size"]) for s in workload) + data.draw(
        st.integers(0, 6))                     # little room to spare: preemption is the rule
    watch = RankWatch()
    h = run_workload(workload, config, observe=watch)
    assert_all_released(h)
    assert all(r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
               for r in h.requests.values())
    assert watch.vip_idle_steps <= 1 + config["async_scheduling"]


@settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 4))
@given(st.data())
def test_at_most_max_loras_adapters_run_at_once_and_every_request_finishes(data):
    """Requests of up to five adapters and of the base model under a limit of 1 to 3 adapters:
    no step runs more adapters than the limit (nor do the running groups hold more), every
    request finishes, and the outputs are the unlimited run's."""
    workload = [replace(s, adapter=data.draw(st.sampled_from([None, 1, 2, 3, 4, 5]))) for s in
                data.draw(specs(with_aborts=False))]
    max_loras = data.draw(st.integers(1, 3))
    config = data.draw(configs(workload))

    def observe(h, step):
        scheduled = {seq.request.lora_digest for seq in h.last.scheduled_seqs} - {None}
        assert len(scheduled) <= max_loras and len(h.scheduler.running_adapters()) <= max_loras

    h = run_workload(workload, config, observe=observe,
                     make_harness=lambda **c: Harness(lora=LoRAConfig(max_loras=max_loras), **c))
    assert_all_released(h)
    unlimited = run_workload(workload, REFERENCE, check=False,
                             make_harness=lambda **c: Harness(lora=LoRAConfig(max_loras=5), **c))
    assert h.outputs() == unlimited.outputs()


def test_a_beam_swapped_out_while_its_step_ran_starts_again_when_its_window_has_moved_on():
    """Found by the windowed search above: a beam search swapped out by the step run ahead while
    its own step ran computes that position again once back, whose window reaches a block the
    group gave back when that step was scheduled; such a group starts again from token 0."""
    spec = dict(min_tokens=0, ignore_eos=False, abort_step=None)
    workload = [Spec("r0", (1,), 3, 1, priority=1, arrival_step=0, beam=2, **spec),
                Spec("r1", (1,), 2, 2, priority=0, arrival_step=1, **spec),
                Spec("r2", (1,), 1, 1, priority=0, arrival_step=0, **spec)]
    config = dict(block_size=1, num_gpu_blocks=17, num_cpu_blocks=256, watermark=0.0, enable_prefix_caching=False,
                  max_num_batched_tokens=4, max_num_seqs=4, max_model_len=256, enable_chunked_prefill=False,
                  long_prefill_token_threshold=0, max_num_partial_prefills=1, policy="priority",
                  preemption_mode="auto", async_scheduling=True, group_windows=(None, 3))
    h = run_workload(workload, config)
    assert h.outputs() == run_workload(workload, REFERENCE, check=False).outputs()
    assert_all_released(h)
