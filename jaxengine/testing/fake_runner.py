"""Deterministic stand-ins for the model runner, so the whole engine loop runs on the CPU
before any model exists.

``HashRunner`` simulates the paged KV cache: it writes each computed token into its slot
(block table + offset), applies the swap and copy lists, and samples a token that is a hash of
the context *read back through the block table*. A wrong block table, a bad prefix-cache hit or
a missed copy-on-write changes the tokens, so "outputs do not depend on scheduling" checks the
KV cache manager too. Rows that ask for logprobs (beam search's candidates) get a top-k drawn
from the same hash: distinct tokens with decreasing log-probabilities. With ``speculative`` it
proposes drafts after each step by prompt lookup, as the model runner does (``out.propose``);
for a method whose proposer has a KV cache of its own (a draft model, a head) it also writes
``PROPOSED`` into the slots of the positions it drafts, as that cache does, so a proposal slot
the scheduler did not allocate fails, and one it counted as computed changes the tokens.
With layer groups (``group_windows``) it writes each token into every group's table, and a row
reads its context through the full-attention group's table (where the model has one; else it
samples from its tokens) and, through each windowed group's, every position its tokens' windows
reach, which must hold the tokens written there: a block given back while a window still reached
it, and written over by its next owner, fails the step. With recurrent state slots
(``num_state_slots``) each slot holds the tokens its sequence's state has consumed: a row must
find there exactly the tokens before its first (a row at token 0 starts afresh), so a state lost,
swapped back into the wrong slot or not copied at a fork fails the step; a step's snapshots
(``state_snapshots``) keep the tokens before their position, so a prefix hit that resumes from a
wrong or overwritten snapshot fails too.
``ConstantRunner`` samples one fixed token (for host-cost benchmarks).
"""
from __future__ import annotations

import zlib

import numpy as np

from jaxengine.config import MODEL_PROPOSERS, SpeculativeConfig
from jaxengine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxengine.spec_decode.ngram import NgramProposer
from jaxengine.spec_decode.verify import accepted_tokens

UNWRITTEN = -1
PROPOSED = -2           # what a proposer with a KV cache of its own leaves at the positions it drafted


class HashRunner:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, vocab_size: int = 1000,
                 speculative: SpeculativeConfig | None = None, group_windows: tuple[int | None, ...] = (None,),
                 num_state_slots: int = 0) -> None:
        self.block_size = block_size
        self.group_windows = group_windows
        self.group_tables: dict[int, list[list[int]]] = {}
        self.state_slot: dict[int, int] = {}                     # seq_id -> its state slot (0: none)
        self.device_state: dict[int, tuple[int, ...]] = {}       # slot -> the tokens its state consumed
        self.host_state: dict[int, tuple[int, ...]] = {}
        self.ngram = None if speculative is None else NgramProposer(
            speculative.num_speculative_tokens, speculative.prompt_lookup_max, speculative.prompt_lookup_min)
        self.proposal_writes_kv = speculative is not None and speculative.method in MODEL_PROPOSERS
        self.vocab_size = vocab_size
        self.device_kv = np.full((num_gpu_blocks, block_size), UNWRITTEN, np.int64)
        self.host_kv = np.full((max(num_cpu_blocks, 1), block_size), UNWRITTEN, np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.num_logprobs: dict[int, int | None] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._sync_state(out)
        self._apply_block_moves(out)
        sampled, logprobs = [], []
        for seq_id, start, n, k in zip(out.seq_ids, out.num_computed_tokens, out.num_scheduled_tokens,
                                       out.num_samples):
            draft = out.draft_token_ids.get(seq_id)
            if draft:
                self._verify(seq_id, start, draft, sampled, logprobs)
                continue
            self._write(seq_id, start, n)
            self._check_windows(seq_id, start, start + n)
            self._advance_state(seq_id, start, n)
            sampled.append([self._sample(seq_id, start + n, i) for i in range(k)])
            top_k = self.num_logprobs[seq_id]
            logprobs.append(None if top_k is None else [self._top(seq_id, start + n, i, top_k) for i in range(k)])
            if sampled[-1]:   # at a fork the leader keeps the first sample; siblings arrive as new
                self.tokens[seq_id].append(sampled[-1][0])
        for row, position, slot in out.state_snapshots:      # the states the step keeps for the prefix cache
            self.device_state[slot] = tuple(self.tokens[out.seq_ids[row]][:position + 1])
        return ModelRunnerOutput(sampled, logprobs if any(row is not None for row in logprobs) else None,
                                 draft_token_ids=self._propose(out) if out.propose else {})

    def _propose(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Each asked-for sequence's draft after the step, from its tokens now."""
        drafts = {}
        for seq_id, n in out.propose.items():
            tokens = self.tokens[seq_id]
            if self.proposal_writes_kv:      # from the last token's position on, n of them
                table, bs = self.tables[seq_id], self.block_size
                for pos in range(len(tokens) - 1, len(tokens) - 1 + n):
                    assert pos // bs < len(table) and table[pos // bs] != 0, \
                        f"sequence {seq_id} proposes at position {pos} without a slot"
                    self.device_kv[table[pos // bs], pos % bs] = PROPOSED
            drafts[seq_id] = self.ngram.propose(tokens, n)
        return drafts

    def _verify(self, seq_id: int, start: int, draft: list[int], sampled: list, logprobs: list) -> None:
        """A row with a draft: its input token and the draft are written, each position samples
        from the context read back through the block table, and the row outputs what
        ``spec_decode.verify`` accepts (so a rejected draft's KV left in a block shows up as a
        wrong token in a later step if the scheduler ever counted it as computed)."""
        tokens = self.tokens[seq_id]
        assert not self.state_slot.get(seq_id), "drafts would run a recurrent state past rejected tokens"
        tokens[start + 1:] = draft
        self._write(seq_id, start, 1 + len(draft))
        self._check_windows(seq_id, start, start + 1 + len(draft))
        samples = [self._sample(seq_id, start + 1 + j, 0) for j in range(len(draft) + 1)]
        kept = accepted_tokens(draft, samples)
        tokens[start + 1:] = kept
        sampled.append(kept)
        top_k = self.num_logprobs[seq_id]
        logprobs.append(None if top_k is None else [self._top(seq_id, start + 1 + j, 0, top_k) for j in range(len(kept))])

    def _sync_state(self, out: SchedulerOutput) -> None:
        for seq_id in (*out.finished_seq_ids, *out.preempted_seq_ids):
            for d in (self.tokens, self.tables, self.num_logprobs, self.group_tables, self.state_slot):
                d.pop(seq_id, None)
        for new in out.new_seqs:
            self.state_slot[new.seq_id] = new.state_slot
            self.tokens[new.seq_id] = list(new.token_ids)
            self.tables[new.seq_id] = list(new.block_table)
            self.group_tables[new.seq_id] = [list(t) for t in new.group_tables]
            self.num_logprobs[new.seq_id] = new.sampling_params.logprobs
        for seq_id, table in out.block_tables.items():
            self.tables[seq_id] = list(table)
            self.group_tables[seq_id] = [list(t) for t in out.group_tables.get(seq_id, ())]

    def _apply_block_moves(self, out: SchedulerOutput) -> None:
        for dev, host in out.blocks_to_swap_out:
            self.host_kv[host] = self.device_kv[dev]
        for host, dev in out.blocks_to_swap_in:
            self.device_kv[dev] = self.host_kv[host]
        for src, dst in out.blocks_to_copy:
            self.device_kv[dst] = self.device_kv[src]
        for src, dst in out.states_to_copy:
            self.device_state[dst] = self.device_state.get(src)
        for dev, host in out.states_to_swap_out:
            self.host_state[host] = self.device_state.get(dev)
        for host, dev in out.states_to_swap_in:
            self.device_state[dev] = self.host_state.get(host)

    def _advance_state(self, seq_id: int, start: int, n: int) -> None:
        """The row's recurrent state, read from its slot, consumes its tokens."""
        slot, tokens = self.state_slot.get(seq_id), self.tokens[seq_id]
        if slot:
            assert start == 0 or self.device_state.get(slot) == tuple(tokens[:start]), \
                f"sequence {seq_id}: its state slot {slot} does not hold the state of its first {start} tokens"
            self.device_state[slot] = tuple(tokens[:start + n])

    def _write(self, seq_id: int, start: int, n: int) -> None:
        tokens, bs = self.tokens[seq_id], self.block_size
        for table in (self.tables[seq_id], *self.group_tables.get(seq_id, ())):
            for pos in range(start, start + n):
                block = table[pos // bs]
                assert block != 0, f"sequence {seq_id} writes into the null block at position {pos}"
                self.device_kv[block, pos % bs] = tokens[pos]

    def _check_windows(self, seq_id: int, start: int, end: int) -> None:
        """Each windowed group's table holds the tokens at every position the windows of the row's
        tokens (``start`` to ``end``) reach."""
        tokens, bs = self.tokens[seq_id], self.block_size
        for window, table in zip(self.group_windows, (self.tables[seq_id], *self.group_tables.get(seq_id, ()))):
            if window is None:
                continue
            for pos in range(max(0, start - window + 1), end):
                assert self.device_kv[table[pos // bs], pos % bs] == tokens[pos], \
                    f"sequence {seq_id}: its window reaches position {pos}, which its block no longer holds"

    def _context(self, seq_id: int, num_computed: int) -> np.ndarray:
        """The tokens a row attends to, read through a full-attention group's table (without one,
        its own tokens: ``_check_windows`` read what its windows reach)."""
        full = [t for w, t in zip(self.group_windows, (self.tables[seq_id], *self.group_tables.get(seq_id, ())))
                if w is None]
        if not full:
            return np.asarray(self.tokens[seq_id][:num_computed], np.int64)
        context = self.device_kv[full[0]].reshape(-1)[:num_computed]
        assert (context != UNWRITTEN).all(), f"sequence {seq_id} reads unwritten KV"
        return context

    def _sample(self, seq_id: int, num_computed: int, sample_index: int) -> int:
        context = self._context(seq_id, num_computed)
        return zlib.crc32(context.tobytes(), sample_index) % self.vocab_size

    def _top(self, seq_id: int, num_computed: int, sample_index: int, k: int) -> tuple[float, dict[int, float]]:
        """(logprob of the sampled token, top-k {token: logprob} best first), from the context's hash."""
        context = self._context(seq_id, num_computed)
        rng = np.random.default_rng(zlib.crc32(context.tobytes(), sample_index))
        tokens = rng.permutation(self.vocab_size)[:k].tolist()
        logprobs = (-np.cumsum(rng.exponential(1.0, k))).tolist()
        return logprobs[0], dict(zip(tokens, logprobs))


class ConstantRunner:
    """Samples ``token`` for every row that samples; no device work at all."""

    def __init__(self, token: int = 1) -> None:
        self.token = token

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t = self.token
        return ModelRunnerOutput([[t] * k if k != 1 else [t] for k in out.num_samples])
