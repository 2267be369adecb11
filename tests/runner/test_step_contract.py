"""The step contract: each row of a SchedulerOutput states its computed-token count and, under
async scheduling, which sample row of the previous step is its input token; the runner's
InputBatch builds the attention and sampling metadata from that alone."""
from __future__ import annotations

import jax
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.core.scheduler_output import NewSequenceData, SchedulerOutput
from jaxengine.request import PLACEHOLDER, RequestStatus
from jaxengine.testing.fake_runner import HashRunner
from jaxengine.runner.input_batch import InputBatch
from jaxengine.sampling_params import SamplingParams

from tests.core.test_scheduler_properties import configs, run_workload, specs
from tests.helpers import Harness


class ContractCheckingRunner(HashRunner):
    """Checks every row against its own record of what earlier steps computed and sampled, and
    that it never holds more sequences than max_num_seqs (the real runner's slots)."""

    def __init__(self, *args, max_num_seqs: int) -> None:
        super().__init__(*args)
        self.max_num_seqs = max_num_seqs
        self.done: dict[int, int] = {}          # seq id -> tokens computed by the steps so far
        self.held: set[int] = set()             # sequences seen, not yet finished or preempted
        self.sample_rows: list[int] = []        # the previous step's sample rows -> seq id
        self.num_from_previous = 0

    def execute(self, out: SchedulerOutput):
        for seq_id in (*out.finished_seq_ids, *out.preempted_seq_ids):
            self.done.pop(seq_id, None)
            self.held.discard(seq_id)
        new = {s.seq_id for s in out.new_seqs}
        self.held |= new
        assert len(self.held) <= self.max_num_seqs, (sorted(self.held), self.max_num_seqs)
        rows = zip(out.scheduled_seqs, out.num_computed_tokens, out.num_scheduled_tokens, out.previous_sample_rows)
        for seq, computed, n, previous in rows:
            assert seq.seq_id in new or computed == self.done[seq.seq_id]
            last = seq.token_ids[computed + n - 1]
            if previous >= 0:
                assert self.sample_rows[previous] == seq.seq_id and last == PLACEHOLDER and n == 1
                self.num_from_previous += 1
            else:
                assert last != PLACEHOLDER
            self.done[seq.seq_id] = computed + n
        self.sample_rows = [s for s, k in zip(out.seq_ids, out.num_samples) for _ in range(k)]
        return super().execute(out)


def checked_harness(**config) -> Harness:
    h = Harness(**config)
    cache = h.config.cache
    h.runner = h.engine.runner = ContractCheckingRunner(cache.num_gpu_blocks, cache.num_cpu_blocks, cache.block_size,
                                                        max_num_seqs=h.config.scheduler.max_num_seqs)
    return h


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_row_states_its_progress_and_where_its_input_token_is(data):
    workload = data.draw(specs(with_aborts=True))
    config = {**data.draw(configs(workload)), "async_scheduling": data.draw(st.booleans())}
    h = run_workload(workload, config, make_harness=checked_harness)
    assert not h.scheduler.has_unfinished_requests()


def test_async_decodes_take_their_token_from_the_previous_step():
    h = checked_harness(async_scheduling=True)
    h.add("a", 5, max_tokens=6)
    h.add("b", 3, max_tokens=4)
    h.run()
    # a: 5 decodes, b: 3 decodes after their prefills, each fed from the step before.
    assert h.runner.num_from_previous == 5 + 3


def new_seq(seq_id: int, tokens: list[int], table: list[int], num_prompt: int, **params) -> NewSequenceData:
    return NewSequenceData(seq_id, f"r{seq_id}", tokens, table, SamplingParams(**params), 0, 7, num_prompt)


def test_step_inputs_are_a_pytree_of_their_arrays():
    """The channel to other processes sends the leaves and rebuilds from a template's treedef:
    the leaves are every array in field order, the host-side count is static."""
    batch = InputBatch(4, 32, 8, 4, [16], [8])
    out = SchedulerOutput(seq_ids=[10], num_scheduled_tokens=[3], num_samples=[1], num_computed_tokens=[0],
                          previous_sample_rows=[-1], new_seqs=[new_seq(10, [1, 2, 3], [3], 3)])
    batch.update(out)
    inputs, _ = batch.prepare(out)
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    assert leaves[0] is inputs.input_ids and leaves[1] is inputs.prev_index and leaves[-1] is inputs.prompt_lp_target
    assert all(hasattr(leaf, "dtype") for leaf in leaves)
    rebuilt = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch.padded(16, 8)), leaves)
    assert rebuilt.bucket == inputs.bucket and rebuilt.num_sample_rows == 0 and rebuilt.input_ids is inputs.input_ids
    assert jax.tree_util.tree_unflatten(treedef, leaves).num_sample_rows == inputs.num_sample_rows == 1


def test_input_batch_builds_the_metadata_from_the_rows():
    """A prefill after a 4-token prefix hit (row 0) and a decode whose token is the previous
    step's sample row 1, still on the device (row 1); blocks of 4 tokens."""
    batch = InputBatch(4, 32, 8, 4, [16], [8])
    out = SchedulerOutput(seq_ids=[10, 11], num_scheduled_tokens=[3, 1], num_samples=[1, 1],
                          num_computed_tokens=[4, 6], previous_sample_rows=[-1, 1],
                          new_seqs=[new_seq(10, [1, 2, 3, 4, 5, 6, 7], [3, 5], 7, temperature=0.5),
                                    new_seq(11, [9, 8, 7, 6, 5, 4], [2, 6], 4, presence_penalty=1.0)])
    batch.update(out)
    inputs, slots = batch.prepare(out)
    assert inputs.bucket == (16, 8) and inputs.num_sample_rows == 2
    assert inputs.input_ids[:4].tolist() == [5, 6, 7, 0] and inputs.prev_index[:5].tolist() == [-1, -1, -1, 1, -1]
    md = inputs.attention
    assert md.positions[:4].tolist() == [4, 5, 6, 6]
    assert md.slot_mapping[:4].tolist() == [5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 6 * 4 + 2]
    assert md.query_start_loc.tolist() == [0, 3, 4, 4, 4, 4, 4, 4, 4] and md.seq_lens.tolist() == [7, 7] + [0] * 6
    assert md.block_tables[:2, :2].tolist() == [[3, 5], [2, 6]] and not md.block_tables[2:].any()
    sm = inputs.sampling
    assert inputs.logits_indices[:2].tolist() == [2, 3]
    assert sm.step[:2].tolist() == [0, 3] and sm.temperature[:2].tolist() == [0.5, 1.0]
    assert sm.seed[:2].tolist() == [[0, 7], [0, 7]] and sm.presence_penalty[:2].tolist() == [0.0, 1.0]
    assert sm.history[1, :6].tolist() == [9, 8, 7, 6, 5, 4] and sm.num_history[:2].tolist() == [7, 7]
    assert sm.num_prompt[:2].tolist() == [7, 4]
    # The results join the token buffer after each row's tokens; a slot taken over meanwhile keeps its own.
    batch.update(SchedulerOutput(finished_seq_ids=[11], new_seqs=[new_seq(12, [1, 1], [4], 2)]))
    batch.record_samples(out, slots, [[40], [41]])
    assert batch.tokens[slots[0], :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 40]
    assert batch.slot_of[12] == slots[1] and batch.tokens[slots[1], :8].tolist() == [1, 1, 7, 6, 5, 4, 0, 0]


def test_a_group_ending_by_length_with_its_last_tokens_in_flight_holds_its_seats():
    """Async scheduling: a group of 4 that outgrows the pool while its last tokens are on the
    device ends by length and keeps its 4 seats until those tokens are back, so a waiting request
    that would fit the pool's free blocks is not admitted past max_num_seqs=4 meanwhile (the
    runner holds a slot per sequence: it would have 5)."""
    h = checked_harness(async_scheduling=True, num_gpu_blocks=12, max_num_seqs=4)     # 11 usable blocks
    g = h.add("g", 4, n=4, max_tokens=20)
    w = h.add("w", 2, max_tokens=2)
    h.run()
    assert g.status is RequestStatus.FINISHED_LENGTH and [s.num_output_tokens for s in g.seqs] == [9] * 4
    assert w.status is RequestStatus.FINISHED_LENGTH and w.seqs[0].num_output_tokens == 2
    assert h.kv.num_free_blocks == 11
