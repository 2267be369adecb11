"""The paged KV cache manager: block tables, prefix caching, copy-on-write and swapping.

Invariants (checked by the property tests): every block's ref count equals the number of
block tables holding it; a block is in the free queue iff its ref count is 0; free + used
blocks = the pool; a failed allocation changes nothing.

Layer groups (``CacheConfig.group_windows``): a model whose layers keep different memory has a
block table per group, all from the one pool and all as long as each other (position i of every
table holds the KV of the sequence's i-th block of tokens in that group's layers). A windowed
group's table holds the null block 0 at the positions its sliding window has passed: those blocks
go back to the pool (``slide``), so a sequence holds about a window of them however long it grows.
A prefix hit needs every block in a full group's table and only those a windowed group's window
still reaches at the hit point. Group 0 is a full-attention group whenever the model has one.

Recurrent layers (``CacheConfig.num_state_slots``): each sequence holding blocks holds one slot of
the state pool too (their state is fixed-size, whatever the length): taken with its first blocks,
given back with them, moved to a host slot and back with its blocks when its group is swapped, and
copied into a new slot when it forks (``take_state_moves``). A row that starts at token 0 starts
from the initial state whatever its slot holds. Prefix hits need the state at the hit point: with
prefix caching a step snapshots a row's state at each multiple of ``state_snapshot_interval`` it
computes into a free slot (``take_snapshots``), which joins the state pool's prefix index under
the chained hash of the blocks before it once those are cached (``cache_full_blocks``), and is
evicted as cached KV blocks are (least recently used first). A hit resumes at the longest cached
prefix that has a snapshot at its end: the sequence's own slot starts as a copy of it.

Ownership: this manager is the only writer of a sequence's ``block_table``, ``group_tables``,
``block_hashes`` and ``num_cached_blocks`` and of the copy-on-write list; a sequence's progress
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
    """A prefix-cache hit: leading blocks whose KV is already in the cache (group 0's; the other
    groups' in ``group_blocks``, as long, the null block where a window no longer reaches)."""

    blocks: list[int] = field(default_factory=list)
    num_evictable: int = 0     # hit blocks with no holder: they sit in the free queue
    group_blocks: list[list[int]] = field(default_factory=list)
    state_snapshot: int | None = None   # recurrent layers: the slot holding the state at the hit point


NO_HIT = ComputedBlocks()


NULL_BLOCK = 0       # a device table's entry where a window has passed (and what padding points to)
HOST_NULL = -1       # the same entry in a swapped-out sequence's table (host block 0 is a real block)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of ``group``: each group's blocks hold other layers' KV."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


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
        self.group_windows = config.group_windows
        self.state_pool = BlockPool(config.num_state_slots) if config.num_state_slots else None
        self.host_state_pool = BlockPool(config.num_cpu_state_slots, reserve_null_block=False)
        self._state_moves: tuple[list, list, list] = ([], [], [])   # copies, swaps out, swaps in
        self.snapshot_interval = config.state_snapshot_interval if config.enable_prefix_caching else 0
        self.num_groups = len(config.group_windows)
        self.windowed = tuple((g, w) for g, w in enumerate(config.group_windows) if w is not None)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table in every group (group 0's is ``block_table``)."""
        if self.num_groups == 1:
            return [seq.block_table]
        if len(seq.group_tables) != self.num_groups - 1:
            seq.group_tables = [[] for _ in range(self.num_groups - 1)]
        return [seq.block_table, *seq.group_tables]

    def _window_start(self, window: int, position: int) -> int:
        """The first block a token at ``position`` attends to under ``window``."""
        return max(0, position - window + 1) // self.block_size

    def _blocks_held(self, window: int | None, num_tokens: int) -> int:
        """The most blocks of a group a sequence of ``num_tokens`` needs at once, one token a step."""
        blocks = cdiv(num_tokens, self.block_size)
        return blocks if window is None else min(blocks, cdiv(window - 1, self.block_size) + 1)

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
        """Blocks the group's live sequences need for all their current tokens, unshared (a windowed
        group's: those of one window)."""
        if self.num_groups == 1 and not self.windowed:
            return sum(cdiv(s.num_tokens, self.block_size) for s in request.live_seqs)
        return sum(self._blocks_held(w, s.num_tokens) for s in request.live_seqs for w in self.group_windows)

    # ---- prefix cache ----
    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """Longest cached prefix of a sequence that holds no blocks yet. Never covers the last
        token: its logits are needed, so at least one token is always computed."""
        if (not self.enable_caching or seq.block_table or seq.request.prompt_logprobs is not None
                or (self.state_pool is not None and not self.snapshot_interval)):
            return NO_HIT                # prompt logprobs need every prompt token computed
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, num_blocks, self.block_size,
                                     seq.request.prefix_keys)
        hit = ComputedBlocks()
        if self.state_pool is not None:
            k = self._snapshot_length(hashes, self._hit_length(hashes, num_blocks))
            hit = self._group_hit(hashes, k)
            hit.state_snapshot = self.state_pool.lookup(hashes[k - 1]) if k else None
            return hit
        if self.num_groups > 1 or self.windowed:
            return self._group_hit(hashes, self._hit_length(hashes, num_blocks))
        for h in hashes[:num_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.blocks.append(b)
            hit.num_evictable += self.pool.ref_cnt[b] == 0
        return hit

    def _hit_length(self, hashes: list[bytes], num_blocks: int) -> int:
        """The most leading blocks every group can resume from: all of them cached in each full
        group, and in each windowed group those its window reaches from the first token after."""
        lookup = self.pool.lookup
        k = num_blocks
        for g, window in enumerate(self.group_windows):
            if window is None:
                k = next((i for i in range(k) if lookup(group_key(hashes[i], g)) is None), k)
        while k > 0 and not all(lookup(group_key(hashes[i], g)) is not None
                                for g, w in self.windowed for i in range(self._window_start(w, k * self.block_size), k)):
            k -= 1
        return k

    def _snapshot_length(self, hashes: list[bytes], k: int) -> int:
        """The most of ``k`` leading blocks after which a recurrent state snapshot is cached."""
        while k and self.state_pool.lookup(hashes[k - 1]) is None:
            k -= 1
        return k

    def _group_hit(self, hashes: list[bytes], k: int) -> ComputedBlocks:
        """The hit of ``k`` leading blocks in every group (``_hit_length`` says they are cached)."""
        pool, tables = self.pool, []
        for g, window in enumerate(self.group_windows):
            start = 0 if window is None else self._window_start(window, k * self.block_size)
            tables.append([NULL_BLOCK] * start + [pool.lookup(group_key(h, g)) for h in hashes[start:k]])
        evictable = sum(pool.ref_cnt[b] == 0 for table in tables for b in table if b != NULL_BLOCK)
        return ComputedBlocks(tables[0], evictable, tables[1:])

    def cached_prefix_blocks(self, token_ids: list[int], cache_salt: str | None = None,
                             lora_digest: str | None = None) -> int:
        """How many leading blocks of a prompt the prefix cache holds now (as
        ``get_computed_blocks``, never the block of its last token). A query only: no block is
        touched and no hit counted. Hashes block by block and stops at the first miss."""
        if not self.enable_caching or (self.state_pool is not None and not self.snapshot_interval):
            return 0
        hashes: list[bytes] = []
        num_blocks = (len(token_ids) - 1) // self.block_size
        if self.num_groups > 1 or self.windowed or self.state_pool is not None:
            extend_block_hashes(hashes, token_ids, num_blocks, self.block_size, prefix_keys(cache_salt, lora_digest))
            k = self._hit_length(hashes, num_blocks)
            return k if self.state_pool is None else self._snapshot_length(hashes, k)
        for i in range(num_blocks):
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
        if self.num_groups == 1 and not self.windowed:
            table = seq.block_table
            for i in range(seq.num_cached_blocks, num_full):
                self.pool.cache(table[i], hashes[i])
        else:
            for g, table in enumerate(self.tables(seq)):
                for i in range(seq.num_cached_blocks, num_full):
                    if table[i] != NULL_BLOCK:
                        self.pool.cache(table[i], group_key(hashes[i], g))
        seq.num_cached_blocks = num_full
        if seq.pending_snapshots:                  # their blocks' hashes are known now: cached, free
            ready = [(k, slot) for k, slot in seq.pending_snapshots if k <= num_full]
            seq.pending_snapshots = [(k, slot) for k, slot in seq.pending_snapshots if k > num_full]
            for k, slot in ready:
                self.state_pool.cache(slot, hashes[k - 1])
                self.state_pool.free([slot])

    def take_snapshots(self, seq: Sequence, num_computed: int, num_new: int) -> list[tuple[int, int]]:
        """The snapshots a step computing ``num_new`` tokens of ``seq`` after ``num_computed`` takes:
        (position of the token after which, slot) at each multiple of the interval it reaches whose
        state is not cached yet, each into a free slot (the least recently used snapshot's, or none
        left: not taken). The sequence holds the slot until ``cache_full_blocks`` caches it."""
        interval, pool = self.snapshot_interval, self.state_pool
        if not interval or seq.state_slot is None:
            return []
        taken = []
        for end in range((num_computed // interval + 1) * interval, num_computed + num_new + 1, interval):
            k = end // self.block_size
            if (k <= len(seq.block_hashes) and pool.lookup(seq.block_hashes[k - 1]) is not None) \
                    or not pool.free_queue:
                continue
            (slot,) = pool.allocate(1)
            seq.pending_snapshots.append((k, slot))
            taken.append((end - 1, slot))
        return taken

    def _drop_snapshots(self, seq: Sequence) -> None:
        """Snapshots not cached yet go back uncached (a preempted or finished sequence)."""
        if seq.pending_snapshots:
            self.state_pool.free([slot for _, slot in seq.pending_snapshots])
            seq.pending_snapshots = []

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
        if self.state_pool is not None:
            self.state_pool.reset_cache()

    # ---- allocation ----
    def can_allocate(self, request: Request, plan: list[tuple[Sequence, ComputedBlocks, int]],
                     use_watermark: bool = True) -> AllocStatus:
        """Admission check for a waiting group: ``plan`` gives, per sequence, its prefix hit and
        the tokens to schedule now. Keeps ``watermark_blocks`` free for running requests (the
        scheduler drops the watermark when nothing runs: there is nobody to keep room for)."""
        if self.num_blocks_to_hold(request) > self.pool.num_usable_blocks:
            return AllocStatus.NEVER
        groups = self.num_groups
        needed = sum(self._num_new_blocks(seq, hit, n) * groups + hit.num_evictable for seq, hit, n in plan)
        if request.beam is not None and use_watermark:     # the worst case of its next step: a block
            needed += request.max_num_running_seqs * groups   # per beam (alone in the pool, it just goes)
        if len(self.pool.free_queue) - needed < (self.watermark_blocks if use_watermark else 0):
            return AllocStatus.LATER
        if self.state_pool is not None and sum(s.state_slot is None for s, _, _ in plan) > self.state_pool.num_free_blocks:
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
        if self.state_pool is not None and seq.state_slot is None:     # its first: a state slot too
            if not self.state_pool.free_queue or not self._allocate(seq, num_new, hit):
                return False
            if seq.state_slot is None:           # (a hit's snapshot gave it one already)
                seq.state_slot = self._take_state_slot(None)
            return True
        return self._allocate(seq, num_new, hit)

    def _take_state_slot(self, snapshot: int | None) -> int:
        """A state slot for a sequence starting out; after a prefix hit, its state at the hit point
        copied in from the ``snapshot``. The copy runs before the step, ahead of any write into a
        slot taken this step: the snapshot may be evicted meanwhile (its content stays until the
        step), or be the slot taken itself (then it holds the state already)."""
        (slot,) = self.state_pool.allocate(1)
        if snapshot is not None and snapshot != slot:
            self._state_moves[0].append((snapshot, slot))
        return slot

    def _allocate(self, seq: Sequence, num_new: int, hit: ComputedBlocks) -> bool:
        if self.num_groups > 1:
            return self._allocate_groups(seq, num_new, hit)
        cow = self._needs_copy_on_write(seq.block_table, seq)
        if num_new + cow + hit.num_evictable > len(self.pool.free_queue):
            return False
        self.take_hit(seq, hit)
        if cow:
            self._copy_on_write(seq.block_table, seq)
        if num_new:
            seq.block_table.extend(self.pool.allocate(num_new))
        return True

    def _allocate_groups(self, seq: Sequence, num_new: int, hit: ComputedBlocks) -> bool:
        tables = self.tables(seq)
        cows = [table for table in tables if self._needs_copy_on_write(table, seq)]
        if num_new * len(tables) + len(cows) + hit.num_evictable > len(self.pool.free_queue):
            return False
        self.take_hit(seq, hit)
        for table in cows:
            self._copy_on_write(table, seq)
        if num_new:
            for table in tables:
                table.extend(self.pool.allocate(num_new))
        return True

    def slide(self, seq: Sequence) -> None:
        """Give back the blocks of the windowed groups that no token from the next one to compute
        on attends to (the null block takes their place). Call before scheduling the sequence's
        next tokens: a step already launched that read them runs before any new owner writes."""
        if not self.windowed or not seq.block_table:
            return
        tables = self.tables(seq)
        for g, window in self.windowed:
            table = tables[g]
            end = min(self._window_start(window, seq.num_computed_tokens), len(table))
            start = end
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            if start < end:
                self.pool.free(table[start:end])            # the oldest first: evicted first
                table[start:end] = [NULL_BLOCK] * (end - start)

    def _num_new_blocks(self, seq: Sequence, hit: ComputedBlocks, num_new_tokens: int) -> int:
        bs = self.block_size
        num_tokens = seq.num_computed_tokens + len(hit.blocks) * bs + num_new_tokens
        return max(0, cdiv(num_tokens, bs) - len(seq.block_table) - len(hit.blocks))

    def take_hit(self, seq: Sequence, hit: ComputedBlocks) -> int:
        """Hold a prefix hit's blocks; returns their tokens (for the caller to count as computed)."""
        if not hit.blocks:
            return 0
        if self.num_groups > 1 or self.windowed:
            for table, blocks in zip(self.tables(seq), (hit.blocks, *hit.group_blocks)):
                self.pool.touch(b for b in blocks if b != NULL_BLOCK)
                table.extend(blocks)
        else:
            self.pool.touch(hit.blocks)
            seq.block_table.extend(hit.blocks)
        if hit.state_snapshot is not None and seq.state_slot is None:    # its state at the hit point
            seq.state_slot = self._take_state_slot(hit.state_snapshot)
        num_hit_tokens = len(hit.blocks) * self.block_size
        seq.num_cached_blocks = len(seq.block_table)
        seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, num_hit_tokens)
        return num_hit_tokens

    def record_prefix_query(self, seq: Sequence, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _needs_copy_on_write(self, table: list[int], seq: Sequence) -> bool:
        """The sequence's next write into ``table`` lands in a block that another sequence also holds."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(table) and self.pool.ref_cnt[table[i]] > 1

    def _copy_on_write(self, table: list[int], seq: Sequence) -> None:
        i = seq.num_computed_tokens // self.block_size
        src = table[i]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        table[i] = dst
        self.pending_copies.append((src, dst))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all the parent's blocks (a shared partial block is copied on write)."""
        for table in self.tables(parent):
            self.pool.touch(b for b in table if b != NULL_BLOCK)
        child.block_table = list(parent.block_table)
        child.group_tables = [list(t) for t in parent.group_tables]
        if parent.state_slot is not None:          # the pool has a slot per sequence the steps hold
            if not self.state_pool.free_queue:
                raise RuntimeError("fork: no recurrent state slot free (the state pool is sized for "
                                   "every sequence a step can hold, a beam search's forks included)")
            (child.state_slot,) = self.state_pool.allocate(1)
            self._state_moves[0].append((parent.state_slot, child.state_slot))
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        """Give back the blocks past the first ``num_blocks`` (speculative decoding: the slots of
        rejected draft tokens). They were allocated for drafts and never filled with known tokens,
        so none is in the prefix cache."""
        if len(seq.block_table) > num_blocks:
            for table in self.tables(seq):
                self.pool.free(reversed(table[num_blocks:]))
                del table[num_blocks:]

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks, tail first: the tail is the least likely to be reused, so
        it is evicted first."""
        for table in self.tables(seq):
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        seq.block_table = []
        seq.group_tables = []
        seq.num_cached_blocks = 0
        if seq.state_slot is not None:
            self._drop_snapshots(seq)
            self.state_pool.free([seq.state_slot])
            seq.state_slot = None

    def free_swapped(self, seq: Sequence) -> None:
        """Return a swapped-out sequence's host blocks."""
        for table in self.tables(seq):
            self.host_pool.free(b for b in reversed(table) if b != HOST_NULL)
        seq.block_table = []
        seq.group_tables = []
        if seq.state_slot is not None:
            self.host_state_pool.free([seq.state_slot])
            seq.state_slot = None

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
    def can_compute_again(self) -> bool:
        """A position already computed can be computed again from what the sequence holds: no
        recurrent state has consumed it, and no sliding window has given back a block it reads."""
        return self.state_pool is None and not self.windowed

    @property
    def can_swap(self) -> bool:
        """There is a host pool to swap to."""
        return self.host_pool.num_blocks > 0

    # ---- swapping (multi-sequence groups under memory pressure) ----
    def _unique_blocks(self, request: Request, on_device: bool = True) -> set[int]:
        """The group's blocks (in the device pool, or swapped out in the host pool), null entries left out."""
        if self.num_groups == 1:
            blocks = {b for s in request.live_seqs for b in s.block_table}
        else:
            blocks = {b for s in request.live_seqs for table in self.tables(s) for b in table}
        if self.windowed:
            blocks.discard(NULL_BLOCK if on_device else HOST_NULL)
        return blocks

    def can_swap_out(self, request: Request) -> bool:
        return (len(self._unique_blocks(request)) <= self.host_pool.num_free_blocks
                and self._num_states(request) <= self.host_state_pool.num_free_blocks)

    @staticmethod
    def _num_states(request: Request) -> int:
        return sum(s.state_slot is not None for s in request.live_seqs)

    def can_swap_in(self, request: Request, num_new_tokens: list[int], use_watermark: bool = True) -> bool:
        """Room to bring the group back and give each live sequence its next tokens."""
        needed = self._num_blocks_to_swap_in(request, num_new_tokens)
        if self.state_pool is not None and self._num_states(request) > self.state_pool.num_free_blocks:
            return False
        return len(self.pool.free_queue) - needed >= (self.watermark_blocks if use_watermark else 0)

    def _num_blocks_to_swap_in(self, request: Request, num_new_tokens: list[int]) -> int:
        return len(self._unique_blocks(request, on_device=False)) + self._num_blocks_for_step(
            request.live_seqs, num_new_tokens, self.host_pool)

    def _num_blocks_for_step(self, seqs: list[Sequence], num_new_tokens: list[int], pool: BlockPool) -> int:
        """New blocks plus copy-on-write copies for giving each sequence its next tokens, in
        order (the last writer of a shared block writes in place)."""
        needed = 0
        refs: dict[int, int] = {}
        for seq, n in zip(seqs, num_new_tokens):
            needed += self._num_new_blocks(seq, NO_HIT, n) * self.num_groups
            i = seq.num_computed_tokens // self.block_size
            if i < len(seq.block_table):
                for table in self.tables(seq):
                    b = table[i]
                    refs[b] = refs.get(b, pool.ref_cnt[b]) - 1
                    needed += refs[b] > 0
        return needed

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the group's blocks to the host pool; returns (device block, host block) pairs (its
        recurrent states' moves go to ``take_state_moves``)."""
        for seq in request.live_seqs:
            if seq.pending_snapshots:
                self._drop_snapshots(seq)
        self._move_states(request, self.state_pool, self.host_state_pool, self._state_moves[1])
        return self._move(request, self.pool, self.host_pool, NULL_BLOCK, HOST_NULL)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the group's blocks back to the device; returns (host block, device block) pairs."""
        self._move_states(request, self.host_state_pool, self.state_pool, self._state_moves[2])
        mapping = self._move(request, self.host_pool, self.pool, HOST_NULL, NULL_BLOCK)
        for seq in request.live_seqs:
            seq.num_cached_blocks = 0   # fresh device blocks: re-register their content
        return mapping

    @staticmethod
    def _move_states(request: Request, src_pool: BlockPool | None, dst_pool: BlockPool, moves: list) -> None:
        for seq in request.live_seqs:
            if seq.state_slot is not None:
                (slot,) = dst_pool.allocate(1)
                moves.append((seq.state_slot, slot))
                src_pool.free([seq.state_slot])
                seq.state_slot = slot

    def take_state_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """The recurrent state moves made since the last call: copies (parent, child) of forks,
        swaps out (device, host) and swaps in (host, device), for the step to apply in that order."""
        moves, self._state_moves = self._state_moves, ([], [], [])
        return moves

    def _move(self, request: Request, src_pool: BlockPool, dst_pool: BlockPool, src_null: int,
              dst_null: int) -> list[tuple[int, int]]:
        """Each live sequence's tables into ``dst_pool``, a block shared in the source shared in
        the destination; a null entry (a windowed group's passed block) stays null."""
        mapping: dict[int, int] = {src_null: dst_null}
        for seq in request.live_seqs:
            moved = []
            for table in self.tables(seq):
                new_table = []
                for b in table:
                    if b in mapping:
                        if b != src_null:
                            dst_pool.touch([mapping[b]])
                    else:
                        (mapping[b],) = dst_pool.allocate(1)
                    new_table.append(mapping[b])
                src_pool.free(b for b in reversed(table) if b != src_null)
                moved.append(new_table)
            seq.block_table, seq.group_tables = moved[0], moved[1:]
        del mapping[src_null]
        return list(mapping.items())
