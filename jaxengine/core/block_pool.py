"""A fixed pool of KV blocks with reference counts, an LRU free queue and the prefix-cache index."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class FreeBlockQueue:
    """Free blocks in eviction order, front first, with O(1) removal of any block.

    Blocks that hold no cached content go to the front (nothing is lost by reusing them);
    blocks that hold cached content go to the back, so the least recently freed cached block
    is evicted first.
    """

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def popleft(self) -> int:
        return self._queue.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def append(self, block_id: int) -> None:
        self._queue[block_id] = None

    def appendleft(self, block_id: int) -> None:
        self._queue[block_id] = None
        self._queue.move_to_end(block_id, last=False)

    def ids(self) -> list[int]:
        return list(self._queue)


class BlockPool:
    """Owns ``num_blocks`` blocks. With ``reserve_null_block`` block 0 is never handed out
    (padding points at it). A block is free when its ref count is 0; a free block may still hold
    cached content (its hash stays in the index) until it is evicted by a new allocation."""

    def __init__(self, num_blocks: int, *, reserve_null_block: bool = True) -> None:
        self.num_blocks = num_blocks
        first = 1 if reserve_null_block else 0
        self.num_usable_blocks = num_blocks - first
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_block: dict[bytes, int] = {}
        self.free_queue = FreeBlockQueue(range(first, num_blocks))
        if reserve_null_block:
            self.ref_cnt[0] = 1  # never freed, never counted as free

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting cached content."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self.free_queue)} free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        for b in blocks:
            if self.block_hash[b] is not None:
                self._evict(b)
            self.ref_cnt[b] = 1
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a holder to each block (a prefix-cache hit or a fork); revives free cached blocks."""
        ref_cnt = self.ref_cnt
        for b in blocks:
            if ref_cnt[b] == 0:
                self.free_queue.remove(b)
            ref_cnt[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder from each block, in the given order (pass a table tail-first)."""
        ref_cnt = self.ref_cnt
        for b in blocks:
            ref_cnt[b] -= 1
            if ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first writer wins on duplicates)."""
        if block_hash not in self.cached_block and self.block_hash[block_id] is None:
            self.cached_block[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached_block.get(block_hash)

    def _evict(self, block_id: int) -> None:
        del self.cached_block[self.block_hash[block_id]]
        self.block_hash[block_id] = None

    def reset_cache(self) -> None:
        """Forget all cached content; blocks in use stay allocated but are no longer shared."""
        for h, b in list(self.cached_block.items()):
            self.block_hash[b] = None
            if self.ref_cnt[b] == 0:   # keep 'hashless blocks first' order
                self.free_queue.remove(b)
                self.free_queue.appendleft(b)
        self.cached_block.clear()
