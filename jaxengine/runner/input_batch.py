"""Persistent host buffers for the sequences the runner knows, and per-step padded inputs.

State lives in numpy arrays indexed by a slot per sequence (tokens, block table, sampling
parameters); each SchedulerOutput only updates what changed, and a step's inputs, the model's
attention metadata and the sampler's metadata, are gathered from the slots with vectorised
numpy, padded to the step's buckets. Progress is the scheduler's: each row comes with its
computed-token count and, under async scheduling, the sample row of the previous step whose
token (still on the device) is its input. The token buffer learns sampled tokens from results.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxengine.core.scheduler_output import SchedulerOutput
from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.lora_weights import lora_rows
from jaxengine.buckets import step_bucket
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sampling_params import MAX_LOGIT_BIAS
from jaxengine.core.structured_output import ALL_ALLOWED, bitmask_words


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """One step's padded inputs as the compiled step takes them (T tokens, B rows, R sample
    rows; R == B padded). A pytree whose leaves are the arrays, in field order; the host-side
    count is static (it never reaches the device)."""

    input_ids: np.ndarray         # [T]
    prev_index: np.ndarray        # [T] i32: sample row of the previous step whose token this is, or -1
    attention: AttentionMetadata
    logits_indices: np.ndarray    # [R]
    sampling: SamplingMetadata
    prompt_lp_want: np.ndarray    # [T] bool: this token's logits score the next prompt token
    prompt_lp_target: np.ndarray  # [T] i32: that next prompt token
    # [T] i32: the token after each one where the host knows it, else 0 (an EAGLE-3 head's input;
    # None unless the batch is asked for it)
    following_ids: np.ndarray | None = None
    # [2, R] i32: sampled drafts (the runner's): the draft token each sample row verifies (-1:
    # none) and its row in the drafter's distributions; None without them
    sampled_drafts: np.ndarray | None = None
    num_sample_rows: int = field(default=0, metadata={"static": True})   # host-side: how many sample rows are real

    @property
    def bucket(self) -> tuple[int, int]:
        return len(self.input_ids), len(self.attention.seq_lens)


def seed_words(seed: int) -> tuple[int, int]:
    """A signed or unsigned 64-bit seed as its (high, low) 32-bit words (two's complement)."""
    seed &= 0xFFFFFFFFFFFFFFFF
    return seed >> 32, seed & 0xFFFFFFFF


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int, block_size: int,
                 token_buckets: list[int], request_buckets: list[int],
                 placement: jax.sharding.Sharding | None = None, vocab_size: int = 32, num_lora_slots: int = 0,
                 num_groups: int = 1, with_states: bool = False, snapshot_interval: int = 0) -> None:
        """``num_lora_slots``: the model's LoRA slots (0: no adapters; the steps then carry no grouping).
        ``num_groups``: the model's layer groups (``ModelConfig.kv_groups``); with more than one, a
        step's block tables are [G, B, M] and its slot mapping [G, T], a table and a slot per group.
        ``with_states``: the model has recurrent layers; a step's metadata carries each row's state
        slot, and with a ``snapshot_interval`` (``CacheConfig.state_snapshot_interval``) room for
        the snapshots its rows take (at most one per row and one per interval of its tokens)."""
        self.block_size = block_size
        self.num_lora_slots = num_lora_slots
        self.bitmask_words = bitmask_words(vocab_size)
        self.token_buckets, self.request_buckets = token_buckets, request_buckets
        self.max_blocks_per_seq = max_blocks_per_seq
        self.tokens = np.zeros((max_num_seqs, max_model_len + 1), np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_seq), np.int32)   # per layer group
        self.block_tables = self.tables[0]              # group 0's (what a proposer's own cache reads)
        self.state_slots = np.zeros(max_num_seqs, np.int32) if with_states else None
        self.snapshot_interval = snapshot_interval if with_states else 0
        # The float sampling parameters, one row each (a step gathers them in one go):
        # temperature, top_p, min_p, presence, frequency and repetition penalty, logprobs temperature.
        self.float_params = np.zeros((7, max_num_seqs), np.float32)
        self.float_params[(1, 5, 6), :] = 1.0
        self.temperature, self.top_p, self.min_p = self.float_params[:3]
        self.penalties = self.float_params[3:6]
        self.logprobs_temperature = self.float_params[6]
        self.top_k = np.zeros(max_num_seqs, np.int32)
        self.seed = np.zeros((max_num_seqs, 2), np.uint32)            # the 64-bit seed as (high, low) words
        self.sample_index = np.zeros(max_num_seqs, np.int32)
        self.num_logprobs = np.full(max_num_seqs, -1, np.int32)     # -1: none asked for
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, np.int32)
        self.bias_ids = np.zeros((max_num_seqs, MAX_LOGIT_BIAS), np.int32)
        self.bias_values = np.zeros((max_num_seqs, MAX_LOGIT_BIAS), np.float32)
        self.has_bias = np.zeros(max_num_seqs, bool)
        # min_tokens (0 also where the sequence has no stop tokens), each slot's stop tokens as a
        # packed bitmask row (slots with min_tokens only), and whether it is a beam's
        self.vocab_size = vocab_size
        self.min_tokens = np.zeros(max_num_seqs, np.int32)
        self.stop_rows: dict[int, np.ndarray] = {}
        self.beam = np.zeros(max_num_seqs, bool)
        self.slot_of: dict[int, int] = {}
        self._zeros: dict[tuple, jax.Array] = {}
        self.placement = placement          # where device-resident inputs live (replicated over the mesh)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.with_following_ids = False     # StepInputs.following_ids wanted (an EAGLE-3 head reads them)

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
            self.num_prompt_tokens[slot] = new.num_prompt_tokens
            self._set_table(slot, new.block_table, new.group_tables)
            if self.state_slots is not None:
                self.state_slots[slot] = new.state_slot
            p = new.sampling_params
            self.temperature[slot], self.top_p[slot], self.min_p[slot] = p.temperature, p.top_p, p.min_p
            self.top_k[slot] = max(p.top_k, 0)
            self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
            self.num_prompt_logprobs[slot] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
            self.penalties[:, slot] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            self.logprobs_temperature[slot] = p.logprobs_temperature
            bias = list((p.logit_bias or {}).items())
            self.bias_ids[slot], self.bias_values[slot] = 0, 0.0
            self.has_bias[slot] = bool(bias)
            if bias:
                self.bias_ids[slot, :len(bias)], self.bias_values[slot, :len(bias)] = zip(*bias)
            self.seed[slot], self.sample_index[slot] = seed_words(new.seed), new.sample_index
            self._set_stop_tokens(slot, p.min_tokens, new.stop_token_ids, new.beam)
        for seq_id, table in out.block_tables.items():
            self._set_table(self.slot_of[seq_id], table, out.group_tables.get(seq_id, ()))

    def _set_stop_tokens(self, slot: int, min_tokens: int, stop_token_ids, beam: bool) -> None:
        ids = np.asarray([t for t in stop_token_ids if t < self.vocab_size], np.int64)
        self.min_tokens[slot] = min_tokens if len(ids) else 0
        self.beam[slot] = beam
        self.stop_rows.pop(slot, None)
        if self.min_tokens[slot]:
            row = np.zeros(self.bitmask_words, np.uint32)
            np.bitwise_or.at(row, ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
            self.stop_rows[slot] = row.view(np.int32)

    def _set_table(self, slot: int, table: list[int], group_tables=()) -> None:
        for tables, group_table in zip(self.tables, (table, *group_tables)):
            tables[slot, :len(group_table)] = group_table
            tables[slot, len(group_table):] = 0

    # ---- one step's inputs ----
    def prepare(self, out: SchedulerOutput, row_lora_slots: np.ndarray | None = None) -> tuple[StepInputs, np.ndarray]:
        """Padded inputs, plus the slots of the rows. ``row_lora_slots``: each row's adapter slot
        (-1: the base model), with LoRA slots."""
        slots = np.fromiter((self.slot_of[s] for s in out.seq_ids), np.int64, len(out.seq_ids))
        n = np.asarray(out.num_scheduled_tokens, np.int32)
        samples = np.asarray(out.num_samples, np.int32)
        computed = np.asarray(out.num_computed_tokens, np.int32)
        drafted = self._write_drafts(out, slots, computed)
        num_rows, num_tokens, num_samples = len(slots), int(n.sum()), int(samples.sum())
        t_pad, b_pad = step_bucket(num_tokens, max(num_rows, num_samples), self.token_buckets, self.request_buckets)
        ends, seq_lens = np.cumsum(n), computed + n
        token_row = np.repeat(np.arange(num_rows), n)
        token_slot = slots[token_row]
        pos = np.arange(num_tokens) - (ends - n)[token_row] + computed[token_row]
        input_ids, prev_index = self._input_ids(token_slot, pos, ends, out.previous_sample_rows, t_pad)
        attention = self._attention(slots, token_slot, pos, ends, seq_lens, t_pad, b_pad,
                                    None if row_lora_slots is None else row_lora_slots[token_row],
                                    self._snapshots(out, ends - n, computed))
        sampling, logits_indices = self._sampling(slots, samples, ends, seq_lens, b_pad, out.token_bitmask, drafted)
        want, target = self._prompt_logprob_targets(token_slot, pos, t_pad)
        following = self._following_ids(token_slot, pos, t_pad)
        return StepInputs(input_ids, prev_index, attention, logits_indices, sampling, want, target, following,
                          num_sample_rows=num_samples), slots

    def _following_ids(self, token_slot, pos, t_pad: int) -> np.ndarray | None:
        """The buffer's token after each position (a draft, the next prompt token; past a row's
        known tokens whatever the buffer holds, which the head's sync replaces by the sample)."""
        if not self.with_following_ids:
            return None
        following = np.zeros(t_pad, np.int32)
        following[:len(pos)] = self.tokens[token_slot, np.minimum(pos + 1, self.tokens.shape[1] - 1)]
        return following

    def _write_drafts(self, out: SchedulerOutput, slots: np.ndarray, computed: np.ndarray) -> np.ndarray | None:
        """Rows with draft tokens (speculative decoding): the drafts go into the token buffer after
        the row's input token; returns which rows carry one (None: no row does)."""
        if not out.draft_token_ids:
            return None
        drafted = np.zeros(len(slots), bool)
        for i, seq_id in enumerate(out.seq_ids):
            draft = out.draft_token_ids.get(seq_id)
            if draft:
                start = computed[i] + 1
                self.tokens[slots[i], start:start + len(draft)] = draft
                drafted[i] = True
        return drafted

    def _input_ids(self, token_slot, pos, ends, previous_sample_rows: list[int], t_pad: int):
        input_ids = np.zeros(t_pad, np.int32)
        input_ids[:len(pos)] = self.tokens[token_slot, pos]
        prev_index = np.full(t_pad, -1, np.int32)
        previous = np.asarray(previous_sample_rows, np.int32)
        if (previous >= 0).any():          # the row's last token is the previous step's, on the device
            prev_index[ends - 1] = previous
            input_ids[ends[previous >= 0] - 1] = 0
        return input_ids, prev_index

    def _snapshots(self, out: SchedulerOutput, starts: np.ndarray, computed: np.ndarray) -> tuple[list, list]:
        """The step's state snapshots as (slots, flat token indices)."""
        snapshots = out.state_snapshots
        return ([slot for _, _, slot in snapshots],
                [int(starts[row] + position - computed[row]) for row, position, _ in snapshots])

    def _attention(self, slots, token_slot, pos, ends, seq_lens, t_pad: int, b_pad: int,
                   token_lora_slots: np.ndarray | None = None, snapshots=((), ())) -> AttentionMetadata:
        """``token_lora_slots``: each real token's adapter slot (None: all the base model's);
        ``snapshots``: the state snapshots' (slots, flat token indices)."""
        num_rows, num_tokens, bs = len(slots), len(pos), self.block_size
        groups = len(self.tables)
        tokens = np.zeros((1 + groups, t_pad), np.int32)   # positions, slot mapping (a row per layer group)
        tokens[0, :num_tokens] = pos
        tokens[1:, :num_tokens] = self.tables[:, token_slot, pos // bs] * bs + pos % bs
        rows = np.zeros(2 * b_pad + 1, np.int32)           # query start offsets [B + 1], seq_lens [B]
        query_start_loc, padded_seq_lens = rows[:b_pad + 1], rows[b_pad + 1:]
        query_start_loc[1:num_rows + 1] = ends
        query_start_loc[num_rows + 1:] = num_tokens
        padded_seq_lens[:num_rows] = seq_lens
        block_tables = np.zeros((groups, b_pad, self.max_blocks_per_seq), np.int32)
        block_tables[:, :num_rows] = self.tables[:, slots]
        optional = {}
        if self.num_lora_slots:
            base = np.full(num_tokens, -1, np.int32) if token_lora_slots is None else token_lora_slots
            optional = dict(zip(("lora_order", "lora_sizes", "lora_inverse"),
                                lora_rows(base, self.num_lora_slots, t_pad)))
        if self.state_slots is not None:            # padding rows: the null slot
            optional["state_slots"] = state_slots = np.zeros(b_pad, np.int32)
            state_slots[:num_rows] = self.state_slots[slots]
        if self.snapshot_interval:                  # padding: the null slot, after no token
            size = b_pad + t_pad // self.snapshot_interval
            optional["snapshot_slots"] = np.zeros(size, np.int32)
            optional["snapshot_tokens"] = np.full(size, t_pad, np.int32)
            optional["snapshot_slots"][:len(snapshots[0])] = snapshots[0]
            optional["snapshot_tokens"][:len(snapshots[1])] = snapshots[1]
        if groups == 1:
            return AttentionMetadata(tokens[0], tokens[1], query_start_loc, padded_seq_lens, block_tables[0],
                                     **optional)
        return AttentionMetadata(tokens[0], tokens[1:], query_start_loc, padded_seq_lens, block_tables, **optional)

    def _sampling(self, slots, samples, ends, seq_lens, b_pad: int, token_bitmask: np.ndarray | None = None,
                  drafted: np.ndarray | None = None) -> tuple[SamplingMetadata, np.ndarray]:
        """Per sample row (a fork row samples the group's n streams 0..n-1; a row with a draft
        samples each of its positions, each with its own output position's stream; other rows
        their own). Fields of one dtype are rows of one array: few allocations on the per-step path."""
        sample_row = np.repeat(np.arange(len(slots)), samples)
        s, r = slots[sample_row], len(sample_row)
        floats = np.zeros((7, b_pad), np.float32)
        floats[(1, 5, 6), :] = 1.0                         # padding: top_p, repetition penalty off; logprobs at 1
        floats[:, :r] = self.float_params[:, s]
        ints = np.zeros((4, b_pad), np.int32)              # logits index, top_k, sample index, step
        ints[1, :r] = self.top_k[s]
        ints[2, :r] = self.sample_index[s]
        back = 0                                           # a draft's sample rows: positions before the row's last
        if r and samples.max() > 1:
            within = np.arange(r) - (np.cumsum(samples) - samples)[sample_row]
            forks = samples[sample_row] > 1
            if drafted is not None:
                spec = drafted[sample_row]
                back = np.where(spec, samples[sample_row] - 1 - within, 0)
                forks &= ~spec
            ints[2, :r] = np.where(forks, within, ints[2, :r])
        ints[0, :r] = ends[sample_row] - 1 - back
        sample_lens = seq_lens[sample_row] - back          # the context each sample row samples after
        ints[3, :r] = sample_lens - self.num_prompt_tokens[s]
        seed, want = np.zeros((b_pad, 2), np.uint32), np.zeros(b_pad, bool)
        seed[:r], want[:r] = self.seed[s], self.num_logprobs[s] >= 0
        bias_ids, bias_values = self._logit_bias(s, b_pad)
        history, num_prompt, num_history = self._history(s, sample_lens, floats[3:6, :r], b_pad)
        md = SamplingMetadata(
            temperature=floats[0], top_p=floats[1], top_k=ints[1], min_p=floats[2], seed=seed, sample_index=ints[2],
            step=ints[3], want_logprobs=want, presence_penalty=floats[3], frequency_penalty=floats[4],
            repetition_penalty=floats[5], history=history, num_prompt=num_prompt, num_history=num_history,
            bias_ids=bias_ids, bias_values=bias_values, logprobs_temperature=floats[6],
            **self._token_bitmask(token_bitmask, sample_row, b_pad), **self._stop_mask(s, ints[3, :r], b_pad))
        return md, ints[0]

    def _stop_mask(self, s, steps, b_pad: int) -> dict:
        """min_tokens: the stop tokens of the sample rows with fewer output tokens (``steps``:
        each one's output position); in steps without any, the device's zeros."""
        flags = np.zeros((2, b_pad), bool)                 # stop tokens masked, a beam's row
        masked = steps < self.min_tokens[s]
        if not masked.any():
            return {"stop_bitmask": self._device_zeros((b_pad, self.bitmask_words), np.int32),
                    "masks_stops": flags[0], "beam_scores": flags[1]}
        rows = np.flatnonzero(masked)
        bitmask = np.zeros((b_pad, self.bitmask_words), np.int32)
        bitmask[rows] = [self.stop_rows[slot] for slot in s[rows].tolist()]
        flags[0, :len(s)], flags[1, :len(s)] = masked, masked & self.beam[s]
        return {"stop_bitmask": bitmask, "masks_stops": flags[0], "beam_scores": flags[1]}

    def _token_bitmask(self, samples_bitmask: np.ndarray | None, sample_row, b_pad: int) -> dict:
        """Structured output's allowed tokens per sample row (``StructuredOutputManager.fill_bitmask``);
        in steps without a grammar, the device's all-allowed mask."""
        constrained = np.zeros(b_pad, bool)
        if samples_bitmask is None:
            return {"token_bitmask": self._device_full((b_pad, self.bitmask_words), ALL_ALLOWED),
                    "constrained": constrained}
        bitmask = np.full((b_pad, self.bitmask_words), ALL_ALLOWED, np.int32)
        bitmask[:len(sample_row)] = samples_bitmask
        constrained[:len(sample_row)] = True
        return {"token_bitmask": bitmask, "constrained": constrained}

    def _logit_bias(self, s, b_pad: int) -> tuple:
        """The rows' logit bias; in steps without any, the device's zeros."""
        if not self.has_bias[s].any():
            return self._device_zeros((b_pad, MAX_LOGIT_BIAS), np.int32), \
                self._device_zeros((b_pad, MAX_LOGIT_BIAS), np.float32)
        bias_ids = np.zeros((b_pad, MAX_LOGIT_BIAS), np.int32)
        bias_values = np.zeros((b_pad, MAX_LOGIT_BIAS), np.float32)
        bias_ids[:len(s)], bias_values[:len(s)] = self.bias_ids[s], self.bias_values[s]
        return bias_ids, bias_values

    def _history(self, s, seq_lens, penalties, b_pad: int):
        """Token history for the penalties; in steps without them, the device's zero history."""
        counts = np.zeros((2, b_pad), np.int32)            # prompt tokens, valid tokens
        if not ((penalties[:2] != 0).any() or (penalties[2] != 1).any()):
            return self._device_zeros((b_pad, self.tokens.shape[1]), np.int32), counts[0], counts[1]
        history = np.zeros((b_pad, self.tokens.shape[1]), np.int32)
        history[:len(s)] = self.tokens[s]
        counts[0, :len(s)], counts[1, :len(s)] = self.num_prompt_tokens[s], seq_lens
        return history, counts[0], counts[1]

    def _prompt_logprob_targets(self, token_slot, pos, t_pad: int) -> tuple[np.ndarray, np.ndarray]:
        want, target = np.zeros(t_pad, bool), np.zeros(t_pad, np.int32)
        wanted = (self.num_prompt_logprobs[token_slot] >= 0) & (pos < self.num_prompt_tokens[token_slot] - 1)
        if wanted.any():
            want[:len(pos)] = wanted
            following = self.tokens[token_slot, np.minimum(pos + 1, self.tokens.shape[1] - 1)]
            target[:len(pos)] = np.where(wanted, following, 0)
        return want, target

    def padded(self, t_pad: int, b_pad: int) -> StepInputs:
        """All-padding inputs of one bucket (what start-up compilation lowers)."""
        none = np.zeros(0, np.int32)
        attention = self._attention(none, none, none, none, none, t_pad, b_pad)
        sampling, logits_indices = self._sampling(none, none, none, none, b_pad)
        return StepInputs(np.zeros(t_pad, np.int32), np.full(t_pad, -1, np.int32), attention, logits_indices,
                          sampling, np.zeros(t_pad, bool), np.zeros(t_pad, np.int32),
                          np.zeros(t_pad, np.int32) if self.with_following_ids else None)

    def _device_zeros(self, shape: tuple, dtype) -> jax.Array:
        """What a step without penalties or logit bias passes for their large inputs: one
        device-resident array per shape, so such a step builds and sends none."""
        return self._device_full(shape, 0, dtype)

    def _device_full(self, shape: tuple, value, dtype=np.int32) -> jax.Array:
        key = (shape, np.dtype(dtype).name, value)
        array = self._zeros.get(key)
        if array is None:      # setdefault: a background compile may build the same one meanwhile
            array = self._zeros.setdefault(key, jax.device_put(np.full(shape, value, dtype), self.placement))
        return array

    def record_samples(self, out: SchedulerOutput, slots: np.ndarray, sampled: list[list[int]]) -> None:
        """A step's output tokens (``sampled``: each row's, as the runner returns them) join the
        token buffer after each sampling row's tokens, for sequences still in the slot the step
        used: a row's first sample (a fork row's, the leader's). A row with a draft ends after its
        accepted drafts, which the buffer already holds: its last output token goes after them."""
        # A plain loop: a step has few sampling rows, and numpy's per-call cost is what a batch-1
        # step would pay here.
        slot_of, drafts, tokens = self.slot_of, out.draft_token_ids, self.tokens
        for i, (seq_id, row, slot) in enumerate(zip(out.seq_ids, sampled, slots.tolist())):
            if row and slot_of.get(seq_id) == slot:
                position = out.num_computed_tokens[i] + out.num_scheduled_tokens[i]
                draft = drafts.get(seq_id) if drafts else None
                if draft:
                    position -= len(draft) + 1 - len(row)
                tokens[slot, position] = row[-1] if draft else row[0]
