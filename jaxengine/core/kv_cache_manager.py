"""The paged KV cache manager: block tables, prefix caching, copy-on-write and swapping.

Invariants (checked by the property tests): every block's ref count equals the number of
block tables holding it; a block is in the free queue iff its ref count is 0; free + used
blocks = the pool; a failed allocation changes nothing.

Ownership: this manager is the only writer of a sequence's ``block_table``, ``block_hashes``
and ``num_cached_blocks`` and of the copy-on-write list; a sequence's progress
(``num_computed_tokens``) is the scheduler's alone, so a prefix hit or a fork attaches blocks
here and the scheduler counts their tokens.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxengine.config import CacheConfig
from jaxengine.core.block_hash import extend_block_hashes
from jaxengine.core.block_pool import BlockPool
from jaxengine.request import Request, Sequence, prefix_keys


class AllocStatus(enum.Enum):
    OK = "ok"          # can be allocated now
    LATER = "later"    # not now: too few free blocks above the watermark
    NEVER = "never"    # can never fit the pool


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: leading blocks whose KV is already in the cache."""

    blocks: list[int] = field(default_factory=list)
    num_evictable: int = 0     # hit blocks with no holder: they sit in the free queue


NO_HIT = ComputedBlocks()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.watermark_blocks = config.watermark_blocks
        self.pool = BlockPool(config.num_gpu_blocks)
        self.host_pool = BlockPool(config.num_cpu_blocks, reserve_null_block=False)
        self.pending_copies: list[tuple[int, int]] = []   # copy-on-write (src, dst), drained per step
        self.prefix_cache_queries = 0   # prompt tokens looked up
        self.prefix_cache_hits = 0      # of those, tokens served from the cache

    # ---- accounting ----
    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of the device pool held by sequences (cached-but-free blocks count as free)."""
        usable = self.pool.num_usable_blocks
        return (usable - len(self.pool.free_queue)) / usable

    def num_blocks_to_hold(self, request: Request) -> int:
        """Blocks the group's live sequences need for all their current tokens, unshared."""
        return sum(cdiv(s.num_tokens, self.block_size) for s in request.live_seqs)

    # ---- prefix cache ----
    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """Longest cached prefix of a sequence that holds no blocks yet. Never covers the last
        token: its logits are needed, so at least one token is always computed."""
        if not self.enable_caching or seq.block_table or seq.request.prompt_logprobs is not None:
            return NO_HIT                # prompt logprobs need every prompt token computed
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, num_blocks, self.block_size,
                                     seq.request.prefix_keys)
        hit = ComputedBlocks()
        for h in hashes[:num_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.blocks.append(b)
            hit.num_evictable += self.pool.ref_cnt[b] == 0
        return hit

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None,
                             lora_digest: str | None = None) -> int:
        """How many leading blocks of a prompt the prefix cache holds now (as
        ``get_computed_blocks``, never the block of its last token). A query only: no block is
        touched and no hit counted. Hashes block by block and stops at the first miss."""
        if not self.enable_caching:
            return 0
        hashes: list[bytes] = []
        for i in range((len(token_ids) - 1) // self.block_size):
            extend_block_hashes(hashes, token_ids, i + 1, self.block_size, prefix_keys(cache_salt, lora_digest))
            if self.pool.lookup(hashes[i]) is None:
                return i
        return len(hashes)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        num_full = min(seq.num_computed_tokens, seq.num_real_tokens) // self.block_size   # known tokens only
        if num_full <= seq.num_cached_blocks:
            return
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, num_full, self.block_size,
                                     seq.request.prefix_keys)
        table = seq.block_table
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache(table[i], hashes[i])
        seq.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    # ---- allocation ----
    def can_allocate(self, request: Request, plan: list[tuple[Sequence, ComputedBlocks, int]],
                     use_watermark: bool = True) -> AllocStatus:
        """Admission check for a waiting group: ``plan`` gives, per sequence, its prefix hit and
        the tokens to schedule now. Keeps ``watermark_blocks`` free for running requests (the
        scheduler drops the watermark when nothing runs: there is nobody to keep room for)."""
        if self.num_blocks_to_hold(request) > self.pool.num_usable_blocks:
            return AllocStatus.NEVER
        needed = sum(self._num_new_blocks(seq, hit, n) + hit.num_evictable for seq, hit, n in plan)
        if request.beam is not None and use_watermark:     # the worst case of its next step: a block
            needed += request.max_num_running_seqs        # per beam (alone in the pool, it just goes)
        if len(self.pool.free_queue) - needed < (self.watermark_blocks if use_watermark else 0):
            return AllocStatus.LATER
        return AllocStatus.OK

    def can_append_slots(self, request: Request) -> bool:
        """Room for a decode step of every live sequence of the group: each may need a new
        block or a copy-on-write of a shared one; all of them are counted before any is taken."""
        seqs = request.live_seqs
        return len(self.pool.free_queue) >= self._num_blocks_for_step(seqs, [1] * len(seqs), self.pool)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: ComputedBlocks = NO_HIT) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and after a
        prefix hit, which is taken first so no new allocation can evict it; its tokens are the
        caller's to count as computed). All or nothing."""
        num_new = self._num_new_blocks(seq, hit, num_new_tokens)
        cow = self._needs_copy_on_write(seq)
        if num_new + cow + hit.num_evictable > len(self.pool.free_queue):
            return False
        self.take_hit(seq, hit)
        if cow:
            self._copy_on_write(seq)
        if num_new:
            seq.block_table.extend(self.pool.allocate(num_new))
        return True

    def _num_new_blocks(self, seq: Sequence, hit: ComputedBlocks, num_new_tokens: int) -> int:
        bs = self.block_size
        num_tokens = seq.num_computed_tokens + len(hit.blocks) * bs + num_new_tokens
        return max(0, cdiv(num_tokens, bs) - len(seq.block_table) - len(hit.blocks))

    def take_hit(self, seq: Sequence, hit: ComputedBlocks) -> int:
        """Hold a prefix hit's blocks; returns their tokens (for the caller to count as computed)."""
        if not hit.blocks:
            return 0
        self.pool.touch(hit.blocks)
        seq.block_table.extend(hit.blocks)
        num_hit_tokens = len(hit.blocks) * self.block_size
        seq.num_cached_blocks = len(seq.block_table)
        seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, num_hit_tokens)
        return num_hit_tokens

    def record_prefix_query(self, seq: Sequence, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The next write lands in a block that another sequence also holds."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.pool.ref_cnt[seq.block_table[i]] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        i = seq.num_computed_tokens // self.block_size
        src = seq.block_table[i]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        seq.block_table[i] = dst
        self.pending_copies.append((src, dst))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all the parent's blocks (a shared partial block is copied on write)."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        """Give back the blocks past the first ``num_blocks`` (speculative decoding: the slots of
        rejected draft tokens). They were allocated for drafts and never filled with known tokens,
        so none is in the prefix cache."""
        if len(seq.block_table) > num_blocks:
            self.pool.free(reversed(seq.block_table[num_blocks:]))
            del seq.block_table[num_blocks:]

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks, tail first: the tail is the least likely to be reused, so
        it is evicted first."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0

    def free_swapped(self, seq: Sequence) -> None:
        """Return a swapped-out sequence's host blocks."""
        self.host_pool.free(reversed(seq.block_table))
        seq.block_table = []

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (src, dst) made since the last call, for the step to apply."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cancel_copies_into(self, request: Request) -> dict[int, int]:
        """Copies into the group's blocks are void (it is preempted before they run); returns
        {dst: src} of those cancelled, as a swap-out of the group must read from their source."""
        blocks = self._unique_blocks(request)
        redirect = {d: s for s, d in self.pending_copies if d in blocks}
        if redirect:
            self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in redirect]
        return redirect

    @property
    def can_swap(self) -> bool:
        """There is a host pool to swap to."""
        return self.host_pool.num_blocks > 0

    # ---- swapping (multi-sequence groups under memory pressure) ----
    def _unique_blocks(self, request: Request) -> set[int]:
        return {b for s in request.live_seqs for b in s.block_table}

    def can_swap_out(self, request: Request) -> bool:
        return len(self._unique_blocks(request)) <= self.host_pool.num_free_blocks

    def can_swap_in(self, request: Request, num_new_tokens: list[int], use_watermark: bool = True) -> bool:
        """Room to bring the group back and give each live sequence its next tokens."""
        needed = self._num_blocks_to_swap_in(request, num_new_tokens)
        return len(self.pool.free_queue) - needed >= (self.watermark_blocks if use_watermark else 0)

    def _num_blocks_to_swap_in(self, request: Request, num_new_tokens: list[int]) -> int:
        return len(self._unique_blocks(request)) + self._num_blocks_for_step(
            request.live_seqs, num_new_tokens, self.host_pool)

    def _num_blocks_for_step(self, seqs: list[Sequence], num_new_tokens: list[int], pool: BlockPool) -> int:
        """New blocks plus copy-on-write copies for giving each sequence its next tokens, in
        order (the last writer of a shared block writes in place)."""
        needed = 0
        refs: dict[int, int] = {}
        for seq, n in zip(seqs, num_new_tokens):
            needed += self._num_new_blocks(seq, NO_HIT, n)
            i = seq.num_computed_tokens // self.block_size
            if i < len(seq.block_table):
                b = seq.block_table[i]
                refs[b] = refs.get(b, pool.ref_cnt[b]) - 1
                needed += refs[b] > 0
        return needed

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the group's blocks to the host pool; returns (device block, host block) pairs."""
        return self._move(request, self.pool, self.host_pool)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the group's blocks back to the device; returns (host block, device block) pairs."""
        mapping = self._move(request, self.host_pool, self.pool)
        for seq in request.live_seqs:
            seq.num_cached_blocks = 0   # fresh device blocks: re-register their content
        return mapping

    @staticmethod
    def _move(request: Request, src_pool: BlockPool, dst_pool: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in request.live_seqs:
            new_table = []
            for b in seq.block_table:
                if b in mapping:
                    dst_pool.touch([mapping[b]])
                else:
                    (mapping[b],) = dst_pool.allocate(1)
                new_table.append(mapping[b])
            src_pool.free(reversed(seq.block_table))
            seq.block_table = new_table
        return list(mapping.items())
