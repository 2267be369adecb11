import pytest

from jaxengine.core.block_hash import extend_block_hashes, hash_block_tokens
from jaxengine.core.block_pool import BlockPool, FreeBlockQueue


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, 0 free"):
        pool.allocate(1)


def test_free_queue_removes_from_the_middle_and_orders_both_ends():
    q = FreeBlockQueue([1, 2, 3, 4])
    q.remove(3)
    q.append(9)
    q.appendleft(7)
    assert q.ids() == [7, 1, 2, 4, 9]
    assert q.popleft() == 7
    assert len(q) == 4 and 9 in q and 3 not in q


def test_ref_counts_and_free_only_at_zero():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    assert b not in pool.free_queue
    pool.free([b])
    assert pool.ref_cnt[b] == 0 and b in pool.free_queue


def test_lru_eviction_order_cached_blocks_after_empty_ones_tail_first():
    pool = BlockPool(7)
    a = pool.allocate(3)        # [1, 2, 3], a request's table
    b = pool.allocate(2)        # [4, 5]
    for i, block in enumerate(a):
        pool.cache(block, bytes([i]) * 32)
    pool.free(reversed(a))      # a finished request returns its blocks tail first
    pool.free(reversed(b))      # blocks with no cached content go to the front
    assert pool.free_queue.ids() == [4, 5, 6, 3, 2, 1]
    # Allocation takes empty blocks first, then evicts the least recently freed cached block:
    # the tail (3) goes before the head (1), which other requests are likeliest to reuse.
    assert pool.allocate(4) == [4, 5, 6, 3]
    assert pool.lookup(bytes([2]) * 32) is None            # evicted
    assert pool.lookup(bytes([0]) * 32) == 1                # still cached


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h" * 32)
    pool.free([b])
    pool.touch([pool.lookup(b"h" * 32)])
    assert pool.ref_cnt[b] == 1 and b not in pool.free_queue


def test_first_writer_wins_on_duplicate_hashes():
    pool = BlockPool(4)
    x, y = pool.allocate(2)
    pool.cache(x, b"same" * 8)
    pool.cache(y, b"same" * 8)
    assert pool.lookup(b"same" * 8) == x and pool.block_hash[y] is None


def test_reset_cache_forgets_content_and_requeues_free_blocks_first():
    pool = BlockPool(4)
    x, y = pool.allocate(2)
    pool.cache(x, b"x" * 32)
    pool.free([x])
    pool.reset_cache()
    assert pool.lookup(b"x" * 32) is None and pool.block_hash[x] is None
    assert pool.free_queue.ids()[0] == x


def test_block_hashes_chain_over_parents_and_salt():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == h1
    assert hash_block_tokens(h1, [1, 2]) != h1                  # same tokens, other parent
    assert hash_block_tokens(None, [1, 2], ("salt",)) != h1
    hashes = extend_block_hashes([], [1, 2, 3, 4, 5], 2, 2)
    assert hashes == [h1, hash_block_tokens(h1, [3, 4])]
    other = extend_block_hashes([], [9, 9, 3, 4], 2, 2)
    assert other[1] != hashes[1]                                 # equal block, other prefix
    assert extend_block_hashes([], [1, 2], 1, 2, extra_keys=("s",))[0] == hash_block_tokens(None, [1, 2], ("s",))
