"""Persistent host buffers for the sequences the runner knows, and per-step padded inputs.

State lives in numpy arrays indexed by a slot per sequence (tokens, computed count, block
table, sampling parameters); each SchedulerOutput only updates what changed, and a step's
inputs are gathered from the slots with vectorised numpy, padded to the step's buckets.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxengine.core.scheduler_output import SchedulerOutput
from jaxengine.request import PLACEHOLDER
from jaxengine.runner.buckets import pick_bucket
from jaxengine.sampling_params import MAX_LOGIT_BIAS


@dataclass
class StepInputs:
    """Padded host arrays for one step (T tokens, B rows, R sample rows; B == R padded)."""

    input_ids: np.ndarray        # [T]
    positions: np.ndarray        # [T]
    slot_mapping: np.ndarray     # [T]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray         # [B]
    block_tables: np.ndarray     # [B, M]
    logits_indices: np.ndarray   # [R]
    temperature: np.ndarray      # [R]
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray              # [R, 2] u32: high and low words
    sample_index: np.ndarray
    step: np.ndarray
    want_logprobs: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    history: np.ndarray | None    # [R, W]; None when no row applies penalties
    num_prompt: np.ndarray
    num_history: np.ndarray
    bias_ids: np.ndarray          # [R, MAX_LOGIT_BIAS]
    bias_values: np.ndarray
    prompt_lp_want: np.ndarray    # [T] bool: this token's logits score the next prompt token
    prompt_lp_target: np.ndarray  # [T] i32: that next prompt token
    prev_index: np.ndarray        # [T] i32: sample row of the previous step whose token this is, or -1
    num_sample_rows: int = 0      # host-side: how many sample rows are real

    @property
    def bucket(self) -> tuple[int, int]:
        return len(self.input_ids), len(self.seq_lens)


def seed_words(seed: int) -> tuple[int, int]:
    """A signed or unsigned 64-bit seed as its (high, low) 32-bit words (two's complement)."""
    seed &= 0xFFFFFFFFFFFFFFFF
    return seed >> 32, seed & 0xFFFFFFFF


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int, block_size: int,
                 token_buckets: list[int], request_buckets: list[int]) -> None:
        self.block_size = block_size
        self.token_buckets, self.request_buckets = token_buckets, request_buckets
        self.max_blocks_per_seq = max_blocks_per_seq
        self.tokens = np.zeros((max_num_seqs, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed = np.zeros(max_num_seqs, np.int32)
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.temperature = np.zeros(max_num_seqs, np.float32)
        self.top_p = np.ones(max_num_seqs, np.float32)
        self.top_k = np.zeros(max_num_seqs, np.int32)
        self.min_p = np.zeros(max_num_seqs, np.float32)
        self.seed = np.zeros((max_num_seqs, 2), np.uint32)            # the 64-bit seed as (high, low) words
        self.sample_index = np.zeros(max_num_seqs, np.int32)
        self.num_logprobs = np.full(max_num_seqs, -1, np.int32)     # -1: none asked for
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, np.int32)
        self.penalties = np.zeros((max_num_seqs, 3), np.float32)     # presence, frequency, repetition
        self.penalties[:, 2] = 1.0
        self.bias_ids = np.zeros((max_num_seqs, MAX_LOGIT_BIAS), np.int32)
        self.bias_values = np.zeros((max_num_seqs, MAX_LOGIT_BIAS), np.float32)
        self.pending_row = np.full(max_num_seqs, -1, np.int32)   # sample row of a PLACEHOLDER in the last step
        self.slot_of: dict[int, int] = {}
        self._zero_history: dict[int, jax.Array] = {}
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    # ---- state updates from the scheduler ----
    def update(self, out: SchedulerOutput) -> None:
        for seq_id in (*out.finished_seq_ids, *out.preempted_seq_ids):
            if (slot := self.slot_of.pop(seq_id, None)) is not None:
                self.free_slots.append(slot)
        for new in out.new_seqs:
            slot = self.slot_of.get(new.seq_id)
            if slot is None:
                slot = self.slot_of[new.seq_id] = self.free_slots.pop()
            n = len(new.token_ids)
            self.tokens[slot, :n] = new.token_ids
            self.num_tokens[slot] = n
            self.num_prompt_tokens[slot] = new.num_prompt_tokens
            self.num_computed[slot] = new.num_computed_tokens
            self._set_table(slot, new.block_table)
            p = new.sampling_params
            self.temperature[slot], self.top_p[slot], self.min_p[slot] = p.temperature, p.top_p, p.min_p
            self.top_k[slot] = max(p.top_k, 0)
            self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
            self.num_prompt_logprobs[slot] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
            self.penalties[slot] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            bias = list((p.logit_bias or {}).items())
            self.bias_ids[slot], self.bias_values[slot] = 0, 0.0
            if bias:
                self.bias_ids[slot, :len(bias)], self.bias_values[slot, :len(bias)] = zip(*bias)
            self.seed[slot], self.sample_index[slot] = seed_words(new.seed), new.sample_index
        for seq_id, table in out.block_tables.items():
            self._set_table(self.slot_of[seq_id], table)

    def _set_table(self, slot: int, table: list[int]) -> None:
        self.block_tables[slot, :len(table)] = table
        self.block_tables[slot, len(table):] = 0

    # ---- one step's inputs ----
    def prepare(self, out: SchedulerOutput) -> tuple[StepInputs, np.ndarray, np.ndarray]:
        """Padded inputs, plus the slots of the rows and each sample row's row."""
        slots = np.fromiter((self.slot_of[s] for s in out.seq_ids), np.int64, len(out.seq_ids))
        n = np.asarray(out.num_scheduled_tokens, np.int32)
        samples = np.asarray(out.num_samples, np.int32)
        num_rows, num_tokens, num_samples = len(slots), int(n.sum()), int(samples.sum())
        t_pad = pick_bucket(max(num_tokens, 1), self.token_buckets)
        b_pad = pick_bucket(max(num_rows, num_samples, 1), self.request_buckets)
        ends = np.cumsum(n)
        token_row = np.repeat(np.arange(num_rows), n)
        token_slot = slots[token_row]
        pos = np.arange(num_tokens) - (ends - n)[token_row] + self.num_computed[slots][token_row]
        inputs = self.padded(t_pad, b_pad)
        ids = self.tokens[token_slot, pos]
        pending = ids == PLACEHOLDER                     # sampled by the step still on the device
        if pending.any():
            inputs.prev_index[:num_tokens] = np.where(pending, self.pending_row[token_slot], -1)
            ids = np.where(pending, 0, ids)
        inputs.input_ids[:num_tokens] = ids
        inputs.positions[:num_tokens] = pos
        inputs.slot_mapping[:num_tokens] = (self.block_tables[token_slot, pos // self.block_size] * self.block_size
                                            + pos % self.block_size)
        inputs.query_start_loc[1:num_rows + 1] = ends
        inputs.query_start_loc[num_rows + 1:] = num_tokens
        inputs.seq_lens[:num_rows] = self.num_computed[slots] + n
        inputs.block_tables[:num_rows] = self.block_tables[slots]
        want = (self.num_prompt_logprobs[token_slot] >= 0) & (pos < self.num_prompt_tokens[token_slot] - 1)
        if want.any():
            inputs.prompt_lp_want[:num_tokens] = want
            inputs.prompt_lp_target[:num_tokens] = np.where(want, self.tokens[token_slot, np.minimum(
                pos + 1, self.tokens.shape[1] - 1)], 0)
        sample_row = np.repeat(np.arange(num_rows), samples)
        self._fill_sampling(inputs, slots, samples, sample_row, ends)
        inputs.num_sample_rows = num_samples
        return inputs, slots, sample_row

    def _fill_sampling(self, inputs: StepInputs, slots, samples, sample_row, ends) -> None:
        r = len(sample_row)
        s = slots[sample_row]
        inputs.logits_indices[:r] = ends[sample_row] - 1
        inputs.temperature[:r], inputs.top_p[:r] = self.temperature[s], self.top_p[s]
        inputs.top_k[:r], inputs.min_p[:r], inputs.seed[:r] = self.top_k[s], self.min_p[s], self.seed[s]
        # A fork row samples the group's n streams 0..n-1; other rows their own stream.
        first = np.cumsum(samples) - samples
        within = np.arange(r) - first[sample_row]
        inputs.sample_index[:r] = np.where(samples[sample_row] > 1, within, self.sample_index[s])
        inputs.step[:r] = self.num_tokens[s] - self.num_prompt_tokens[s]
        inputs.want_logprobs[:r] = self.num_logprobs[s] >= 0
        pen = self.penalties[s]
        inputs.presence_penalty[:r], inputs.frequency_penalty[:r], inputs.repetition_penalty[:r] = pen.T
        inputs.bias_ids[:r], inputs.bias_values[:r] = self.bias_ids[s], self.bias_values[s]
        if (pen[:, :2] != 0).any() or (pen[:, 2] != 1).any():      # the history only when it is used
            inputs.history = np.zeros((len(inputs.seq_lens), self.tokens.shape[1]), np.int32)
            inputs.history[:r] = self.tokens[s]
            inputs.num_prompt[:r], inputs.num_history[:r] = self.num_prompt_tokens[s], self.num_tokens[s]

    def padded(self, t_pad: int, b_pad: int) -> StepInputs:
        """All-padding inputs of one bucket (also what start-up compilation runs)."""
        z = np.zeros
        return StepInputs(
            input_ids=z(t_pad, np.int32), positions=z(t_pad, np.int32), slot_mapping=z(t_pad, np.int32),
            query_start_loc=z(b_pad + 1, np.int32), seq_lens=z(b_pad, np.int32),
            block_tables=z((b_pad, self.max_blocks_per_seq), np.int32), logits_indices=z(b_pad, np.int32),
            temperature=z(b_pad, np.float32), top_p=np.ones(b_pad, np.float32), top_k=z(b_pad, np.int32),
            min_p=z(b_pad, np.float32), seed=z((b_pad, 2), np.uint32), sample_index=z(b_pad, np.int32),
            step=z(b_pad, np.int32), want_logprobs=z(b_pad, bool), presence_penalty=z(b_pad, np.float32),
            frequency_penalty=z(b_pad, np.float32), repetition_penalty=np.ones(b_pad, np.float32),
            history=None, num_prompt=z(b_pad, np.int32),
            num_history=z(b_pad, np.int32), bias_ids=z((b_pad, MAX_LOGIT_BIAS), np.int32),
            bias_values=z((b_pad, MAX_LOGIT_BIAS), np.float32), prompt_lp_want=z(t_pad, bool),
            prompt_lp_target=z(t_pad, np.int32), prev_index=np.full(t_pad, -1, np.int32))

    def zero_history(self, b_pad: int) -> jax.Array:
        """The history of a step without penalties: one device-resident array per row bucket,
        so such a step builds and sends none."""
        history = self._zero_history.get(b_pad)
        if history is None:
            history = self._zero_history[b_pad] = jax.device_put(np.zeros((b_pad, self.tokens.shape[1]), np.int32))
        return history

    def advance(self, slots: np.ndarray, n: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """At launch: advance computed counts and give each sampling row's sequence a
        PLACEHOLDER token (filled by ``fill`` once the step's tokens are back). Returns the
        (slots, positions) to fill."""
        self.num_computed[slots] += n
        rows = np.flatnonzero(samples > 0)
        sampled = slots[rows]
        positions = self.num_tokens[sampled].copy()
        self.tokens[sampled, positions] = PLACEHOLDER
        self.pending_row[sampled] = (np.cumsum(samples) - samples)[rows]    # its first sample row
        self.num_tokens[sampled] += 1
        return sampled, positions

    def fill(self, slots: np.ndarray, positions: np.ndarray, seq_ids: list[int], tokens: np.ndarray) -> None:
        """The step's tokens replace its placeholders, in slots still held by the same sequence."""
        keep = np.fromiter((self.slot_of.get(s) == slot for s, slot in zip(seq_ids, slots.tolist())), bool,
                           len(seq_ids))
        self.tokens[slots[keep], positions[keep]] = tokens[keep]
