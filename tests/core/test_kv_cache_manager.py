"""KV cache manager: prefix caching, copy-on-write, failed allocations, admission status."""
from jaxengine.config import CacheConfig
from jaxengine.core.kv_cache_manager import AllocStatus, KVCacheManager
from jaxengine.request import Request
from jaxengine.sampling_params import SamplingParams

from tests.helpers import Harness


def make_kv(**kw) -> KVCacheManager:
    return KVCacheManager(CacheConfig(**{"block_size": 4, "num_gpu_blocks": 9, "watermark": 0.0, **kw}))


def seq_of(tokens, salt=None, n=1):
    return Request("r", tokens, SamplingParams(n=n), cache_salt=salt).seqs[0]


def compute(kv, seq, num_tokens):
    """Allocate and mark ``num_tokens`` as computed, as a step would, then cache full blocks."""
    hit = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, num_tokens, hit)
    seq.num_computed_tokens += len(hit.blocks) * kv.block_size + num_tokens     # the scheduler's count
    kv.cache_full_blocks(seq)


def test_prefix_hit_reuses_full_blocks_and_never_covers_the_last_token():
    kv = make_kv()
    a = seq_of(list(range(10)))
    compute(kv, a, 10)                                   # blocks for tokens 0-3, 4-7 cached; 8-9 partial
    b = seq_of(list(range(10)) + [77])
    hit = kv.get_computed_blocks(b)
    assert hit.blocks == a.block_table[:2] and hit.num_evictable == 0
    exact = seq_of(list(range(8)))                       # a prompt of exactly two full blocks
    assert kv.get_computed_blocks(exact).blocks == a.block_table[:1]


def test_hit_blocks_are_shared_by_ref_count_and_counted():
    h = Harness(enable_prefix_caching=True)
    h.add("a", list(range(10)), max_tokens=1)
    h.step()
    h.add("b", list(range(10)), max_tokens=1)
    assert h.step() == {"b": 2}                          # 8 of 10 tokens came from the cache
    assert h.requests["b"].num_cached_tokens == 8
    assert (h.kv.prefix_cache_queries, h.kv.prefix_cache_hits) == (20, 8)


def test_prefix_hits_on_free_blocks_are_not_evicted_by_the_same_allocation():
    kv = make_kv(num_gpu_blocks=5)                       # 4 usable blocks
    a = seq_of(list(range(12)))
    compute(kv, a, 12)                                   # 3 full cached blocks
    cached_blocks = a.block_table[:3]
    kv.free(a)                                           # all 4 blocks free, 3 still cached
    b = seq_of(list(range(12)) + list(range(50, 55)))    # 17 tokens: 3 hit blocks + 2 new
    hit = kv.get_computed_blocks(b)
    assert hit.num_evictable == 3
    assert not kv.allocate_slots(b, 5, hit)              # needs 2 new + 3 revived > 4 free
    c = seq_of(list(range(12)) + [50, 51])               # 14 tokens: 3 hit blocks + 1 new
    hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 2, hit)
    assert c.block_table[:3] == cached_blocks            # the new block did not evict a hit
    assert len(set(c.block_table)) == 4 and kv.num_free_blocks == 0


def test_failed_allocation_changes_nothing():
    kv = make_kv(num_gpu_blocks=4)                       # 3 usable
    a = seq_of(list(range(8)))
    compute(kv, a, 8)
    kv.free(a)
    before = (kv.pool.free_queue.ids(), list(kv.pool.ref_cnt), dict(kv.pool.cached_block))
    b = seq_of(list(range(8)) + list(range(100, 108)))  # hits 2 blocks, needs 3 more: 5 > 3
    hit = kv.get_computed_blocks(b)
    assert len(hit.blocks) == 2
    assert not kv.allocate_slots(b, 8, hit)
    assert (kv.pool.free_queue.ids(), list(kv.pool.ref_cnt), dict(kv.pool.cached_block)) == before
    assert b.block_table == [] and b.num_computed_tokens == 0


def test_cache_salt_isolates_prefixes():
    kv = make_kv()
    a = seq_of(list(range(9)), salt="tenant-a")
    compute(kv, a, 9)
    assert kv.get_computed_blocks(seq_of(list(range(9)))).blocks == []
    assert kv.get_computed_blocks(seq_of(list(range(9)), salt="tenant-b")).blocks == []
    assert kv.get_computed_blocks(seq_of(list(range(9)), salt="tenant-a")).blocks == a.block_table[:2]


def test_reset_prefix_cache_drops_all_hits():
    kv = make_kv()
    a = seq_of(list(range(9)))
    compute(kv, a, 9)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(seq_of(list(range(9)))).blocks == []


def test_can_allocate_ok_later_never_with_watermark():
    kv = make_kv(num_gpu_blocks=11, watermark=0.2)       # 10 usable, 2 kept free
    big = Request("big", list(range(41)), SamplingParams())
    assert kv.can_allocate(big, [(big.seqs[0], kv.get_computed_blocks(big.seqs[0]), 41)]) is AllocStatus.NEVER
    r = Request("r", list(range(32)), SamplingParams())
    plan = [(r.seqs[0], kv.get_computed_blocks(r.seqs[0]), 32)]    # 8 blocks: leaves 2
    assert kv.can_allocate(r, plan) is AllocStatus.OK
    other = seq_of(list(range(4)))
    compute(kv, other, 4)                                            # 9 free now: would leave 1
    assert kv.can_allocate(r, plan) is AllocStatus.LATER
    assert kv.can_allocate(r, plan, use_watermark=False) is AllocStatus.OK


def test_copy_on_write_on_append_to_a_shared_partial_block():
    h = Harness(block_size=4)
    group = h.add("g", 6, max_tokens=3, n=2)
    assert h.step() == {"g": 6}                          # the prompt once, then the group forks
    a, b = group.seqs
    assert a.block_table == b.block_table == [1, 2]      # block 2 holds tokens 4-5: partial, shared
    assert [h.kv.pool.ref_cnt[x] for x in (1, 2)] == [2, 2]
    assert h.step() == {"g": 2}
    assert h.last.blocks_to_copy == [(2, 3)]             # the first writer copies, the last writes in place
    assert a.block_table == [1, 3] and b.block_table == [1, 2]
    assert [h.kv.pool.ref_cnt[x] for x in (1, 2, 3)] == [2, 1, 1]
    assert h.last.block_tables == {a.seq_id: [1, 3]}
    h.run()
    assert a.output_token_ids != b.output_token_ids
    assert h.kv.num_free_blocks == h.kv.num_usable_blocks


def test_a_windowed_group_gives_back_what_its_window_passed_and_a_hit_needs_only_the_window():
    """Full attention beside a window of 6 tokens (blocks of 4): a token at position p attends to
    positions p-5..p, so from the block of p-5 on."""
    kv = make_kv(num_gpu_blocks=40, enable_prefix_caching=True, group_windows=(None, 6))
    a = seq_of(list(range(22)))
    compute(kv, a, 22)                                   # 6 blocks in each group, 5 full ones cached
    full, window = kv.tables(a)
    assert len(full) == len(window) == 6 and kv.num_free_blocks == 39 - 12
    kv.slide(a)                                          # the next token (22) reaches back to 17: block 4
    assert window[:4] == [0] * 4 and 0 not in window[4:] and 0 not in full
    assert kv.num_free_blocks == 39 - 8
    # A prompt sharing 21 tokens: 5 full blocks hit (20 tokens); its token 20 reaches back to 15
    # (block 3), so the windowed group takes blocks 3 and 4 of the hit, and nulls before them.
    b = seq_of(list(range(21)) + [99, 98])
    hit = kv.get_computed_blocks(b)
    assert hit.blocks == full[:5] and len(hit.group_blocks) == 1
    assert hit.group_blocks[0][:3] == [0, 0, 0] and hit.group_blocks[0][4] == window[4]
    # Block 3 of the windowed group went back to the pool, cached: the hit revives it.
    assert hit.group_blocks[0][3] != 0 and kv.pool.ref_cnt[hit.group_blocks[0][3]] == 0
    assert hit.num_evictable == 1
    assert kv.allocate_slots(b, 3, hit)
    b.num_computed_tokens = 20
    assert [kv.pool.ref_cnt[x] for x in kv.tables(b)[1][3:5]] == [1, 2]
    # What a sequence can never do without: a window's blocks per windowed group, all of them per full one.
    long_one = Request("long", list(range(100)), SamplingParams())
    assert kv.num_blocks_to_hold(long_one) == 25 + 3


def test_without_a_full_group_a_hit_is_the_longest_prefix_whose_window_blocks_are_cached():
    kv = make_kv(num_gpu_blocks=40, enable_prefix_caching=True, group_windows=(5,))
    a = seq_of(list(range(30)))
    compute(kv, a, 30)
    kv.slide(a)                                          # next token 30 reaches back to 26: block 6
    assert a.block_table[:6] == [0] * 6
    # Blocks 0-5 were cached when computed and went back to the pool still cached: a prompt that
    # shares 13 tokens resumes after 3 blocks, and needs only block 2 (its token 12 reaches back to 8).
    b = seq_of(list(range(13)) + [99])
    hit = kv.get_computed_blocks(b)
    assert len(hit.blocks) == 3 and hit.blocks[:2] == [0, 0] and hit.blocks[2] != 0
    assert kv.cached_prefix_blocks(list(range(13)) + [99]) == 3


def test_a_recurrent_state_slot_comes_with_the_first_blocks_and_goes_with_them():
    """Slot 0 is the null slot; a sequence takes a slot with its first blocks (all or nothing),
    a fork's child takes one and its parent's state is copied into it, a swap moves it to a host
    slot and back, and no prefix hit is offered (no slot keeps the state at a block boundary)."""
    kv = make_kv(num_gpu_blocks=6, num_cpu_blocks=8, enable_prefix_caching=True, num_state_slots=3,
                 num_cpu_state_slots=2)
    a = seq_of(list(range(10)))
    compute(kv, a, 10)
    assert a.state_slot == 1 and kv.state_pool.num_free_blocks == 1
    big = seq_of(list(range(40)))
    assert not kv.allocate_slots(big, 40) and big.state_slot is None and kv.state_pool.num_free_blocks == 1
    assert kv.get_computed_blocks(seq_of(list(range(10)) + [5])).blocks == []
    assert kv.cached_prefix_blocks(list(range(10)) + [5]) == 0
    child = Request("r", list(range(10)), SamplingParams()).seqs[0]
    kv.fork(a, child)
    assert child.state_slot == 2 and kv.take_state_moves() == ([(1, 2)], [], [])
    kv.free(child)
    assert child.state_slot is None and kv.state_pool.num_free_blocks == 1
    group = a.request
    kv.swap_out(group)
    assert a.state_slot == 0 and kv.take_state_moves() == ([], [(1, 0)], [])   # host slot 0 is a real one
    assert kv.state_pool.num_free_blocks == 2 and kv.host_state_pool.num_free_blocks == 1
    kv.swap_in(group)
    assert a.state_slot == 1 and kv.take_state_moves() == ([], [], [(0, 1)])
    kv.free(a)
    assert a.state_slot is None and kv.state_pool.num_free_blocks == 2
