"""Speculative decoding on the host: the n-gram proposer, and the scheduler with drafts over random
workloads and configurations with the KV-simulating runner (whose tokens hash the context read
back through the block table, so a rejected draft counted as computed, a wrong rollback or a
stale block changes the tokens). Outputs equal those without speculation; after every step the
invariants of the property tests hold, every row's draft fits its budget, max_num_seqs counts the
drafts' sample rows, and the prefix cache's hashes are those of the sequences' own tokens (no
rejected token in any hash); at the end every block is free."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tests.core.test_scheduler_properties as props
from jaxengine.config import SpeculativeConfig
from jaxengine.core.block_hash import extend_block_hashes
from jaxengine.spec_decode.ngram import NgramProposer
from jaxengine.spec_decode.verify import accepted_tokens
from tests.core.test_scheduler_properties import (REFERENCE, SETTINGS, Spec, assert_all_released, check_invariants,
                                                  configs, run_workload, specs)

SPEC_VOCAB = 5          # a tiny vocabulary: n-grams recur and drafts get accepted


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]) == [7, 5, 1]        # the 3-gram's latest match
    assert p.propose([4, 2, 3, 8, 8, 1, 2, 3]) == [8, 8, 1]                    # 2-gram "2 3"
    assert p.propose([5, 6, 7, 8]) == []                                       # nothing recurs
    assert p.propose([1, 2, 1, 2], max_tokens=1) == [1]                        # cut to what is left
    assert p.propose([7, 7]) == [7]                                            # all that follows
    assert p.propose([1, 1, 1, 1, 1, 1]) == [1, 1, 1]                          # a run: a match 3 tokens follow
    assert p.propose([3, 1, 1, 4, 1, 1]) == [4, 1, 1]                          # the latest with 3 after it
    assert p.propose([5, 1, 1, 6, 1, 1, 1]) == [6, 1, 1]                       # none whole: the earliest
    assert NgramProposer(4, 4, 2).propose([3, 1, 5, 3, 1]) == [5, 3, 1]        # min 2: "3 1"
    assert NgramProposer(4, 4, 2).propose([3, 9, 5, 3]) == []                  # a 1-gram is too short


def test_verification_keeps_the_confirmed_drafts_then_the_first_other_sample():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]            # all, and the bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]


def spec_configs(draw):
    """Prompt lookup, or a method whose proposer writes KV of its own at the positions it drafts
    (the fake runner drafts by prompt lookup for it too, and writes there)."""
    k = draw(st.integers(1, 5))
    low = draw(st.integers(1, 2))
    return SpeculativeConfig(method=draw(st.sampled_from(["ngram", "mtp"])), num_speculative_tokens=k,
                             prompt_lookup_min=low, prompt_lookup_max=draw(st.integers(low, 4)))


def check_speculation(h) -> None:
    out, cfg = h.last, h.config.scheduler
    check_invariants(h)
    assert sum(out.num_samples) <= cfg.max_num_seqs                      # drafts' sample rows included
    for seq, n, samples in zip(out.scheduled_seqs, out.num_scheduled_tokens, out.num_samples):
        draft = out.draft_token_ids.get(seq.seq_id)
        if draft:
            assert n == samples == 1 + len(draft) and seq.request.beam is None
    # Proposals only for rows that sample one token this step (a decode next step), never a beam,
    # and within k.
    one_sample = {seq.seq_id for seq, samples in zip(out.scheduled_seqs, out.num_samples)
                  if samples - len(out.draft_token_ids.get(seq.seq_id, ())) == 1 and seq.request.beam is None}
    assert set(out.propose) <= one_sample
    assert all(1 <= n <= h.config.speculative.num_speculative_tokens for n in out.propose.values())
    for group in h.scheduler.running:
        for seq in group.live_seqs:
            hashes = extend_block_hashes([], seq.token_ids, seq.num_cached_blocks, h.kv.block_size,
                                         seq.request.prefix_keys)
            assert seq.block_hashes[:seq.num_cached_blocks] == hashes[:seq.num_cached_blocks]
            # Between steps no sequence holds a block past its tokens (drafts', proposals' slots).
            assert len(seq.block_table) <= -(-len(seq.token_ids) // h.kv.block_size)


@SETTINGS
@given(st.data())
def test_outputs_with_speculation_equal_those_without(data):
    workload = data.draw(specs(with_aborts=False))
    config = {**data.draw(configs(workload)), "speculative": spec_configs(data.draw)}
    old, props.VOCAB = props.VOCAB, SPEC_VOCAB
    try:
        expected = run_workload(workload, REFERENCE, check=False).outputs()
        h = run_workload(workload, config, observe=lambda h, step: check_speculation(h))
    finally:
        props.VOCAB = old
    assert h.outputs() == expected
    assert_all_released(h)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_drafts_are_accepted_rolled_back_and_preempted_over_a_tiny_pool(method):
    """A fixed workload where drafts are accepted and rejected, sequences are preempted (recompute
    and swap) and prompts hit the prefix cache: the same outputs as without speculation, with
    prompt lookup and with a proposer that writes KV at the positions it drafts."""
    workload = [Spec(f"r{i}", (1, 2, 3, 1, 2, 3, 1, 2)[:3 + i % 5] + (i % 4,), 24, 1 + (i % 3 == 0), 0, i // 2, 0,
                     i != 5, None) for i in range(8)]
    config = dict(block_size=2, num_gpu_blocks=30, num_cpu_blocks=16, watermark=0.0, enable_prefix_caching=True,
                  max_num_batched_tokens=20, max_num_seqs=6, max_model_len=256, enable_chunked_prefill=True,
                  long_prefill_token_threshold=0, max_num_partial_prefills=2, policy="fcfs", preemption_mode="auto")
    traces = []
    old, props.VOCAB = props.VOCAB, SPEC_VOCAB
    try:
        expected = run_workload(workload, REFERENCE, check=False).outputs()
        h = run_workload(workload, {**config, "speculative": SpeculativeConfig(method, num_speculative_tokens=3,
                                                                                prompt_lookup_min=1)},
                         observe=lambda h, step: (check_speculation(h), traces.append(h.engine.last_trace)))
    finally:
        props.VOCAB = old
    assert h.outputs() == expected
    drafted, accepted = sum(t.num_draft_tokens for t in traces), sum(t.num_accepted_tokens for t in traces)
    assert 0 < accepted < drafted
    assert sum(t.num_preemptions for t in traces) > 0 and sum(t.num_prefix_hit_tokens for t in traces) > 0
    assert_all_released(h)


def test_a_speculating_engine_does_not_run_ahead():
    from tests.helpers import Harness

    h = Harness(async_scheduling=True, speculative=SpeculativeConfig(prompt_lookup_min=1))
    h.add("a", [1, 2, 1, 2, 1], max_tokens=12)
    h.run()
    assert h.engine.num_run_ahead == 0 and h.requests["a"].is_finished
    assert dataclasses.replace(h.config).speculative.num_speculative_tokens == 4


def test_the_gate_speculates_where_its_measured_step_times_say_it_pays():
    from jaxengine.spec_decode.gate import SpeculationGate, expected_accepted

    gate = SpeculationGate(4, [1, 2, 4, 8, 16, 32, 64])
    assert gate.plan(1, 1, [(4, 0.6)]) == [4]              # nothing measured: try it
    # Batch 1: a step of 1 token takes 20 ms, of 8 tokens 38 ms (this CPU's); acceptance 0.9.
    gate.observe(1, 0.020, False, 0, 0)
    gate.observe(8, 0.038, False, 0, 0)
    gate.observe(2, 0.5, True, 0, 0)                       # a prefill step: not a decode's time
    assert gate.step_s == {1: 0.020, 8: 0.038}
    gate.observe(1, 0.020, False, 36, 40)
    assert gate.alpha == 0.9
    assert gate.plan(1, 1, [(4, 0.9)]) == [3]              # bucket 4 not measured: priced as bucket 1's
    gate.observe(4, 0.034, False, 0, 0)
    assert gate.plan(1, 1, [(4, 0.9)]) == [4] and gate.last_k == 4
    assert round(gate.last_gain, 3) == round((1 + expected_accepted(0.9, 4)) / 0.038 / (1 / 0.020), 3)
    # Batch 32: the drafts take the step from 32 to 64 tokens (all the budget leaves), which costs
    # three times as much.
    gate.observe(32, 0.100, False, 0, 0)
    gate.observe(64, 0.300, False, 0, 0)
    assert gate.plan(32, 32, [(4, 0.9)] * 32, max_draft_tokens=32) == [0] * 32 and gate.last_gain == 1.0
    # Two rows by their own acceptance: the tokens worth the most go first (all four of row 1's,
    # 0.95^4 > 0.5, then row 0's), and the plan stops where the 8-token bucket is full (16 costs 80 ms).
    gate.observe(16, 0.080, False, 0, 0)
    assert gate.plan(2, 2, [(4, 0.5), (4, 0.95)]) == [2, 4] and gate.last_k == 4
    assert gate.plan(2, 2, [(4, 0.5), (4, 0.95)], max_draft_tokens=4) == [0, 4]
    assert gate.row_alpha(0.0, 0.0) == gate.alpha and gate.row_alpha(10.0, 10.0) > gate.alpha
    # A low acceptance switches it off at batch 1 too.
    for _ in range(40):
        gate.observe(1, 0.020, False, 1, 20)
    assert gate.alpha < 0.1 and gate.plan(1, 1, [(4, gate.alpha)]) == [1]      # bucket 2 not measured: try it
    gate.observe(2, 0.025, False, 0, 0)
    assert gate.plan(1, 1, [(4, gate.alpha)]) == [0]
    assert gate.plan(1, 1, []) == [] and gate.last_gain == 0.0


def test_verification_of_sampled_rows_keeps_the_target_distribution():
    """A small vocabulary: the target's distribution at two positions (the second given the first
    is the draft's token), a one-token draft, 4,000 seeded streams through the engine's sampler
    and ``accepted_tokens``. The first output token is distributed as the target's first
    position (chi-square), the second (when the draft was accepted) as its second; and each
    stream's output is what that stream samples without speculation, token for token."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.sample.metadata import SamplingMetadata
    from jaxengine.sample.sampler import sample

    p = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1]])      # positions 0 and 1 (after the draft token)
    draft, n = [0], 4000

    def stream(position: int):
        """Every stream's token at output ``position`` (the per-request key of seed and position)."""
        rows = n
        md = SamplingMetadata(
            temperature=jnp.ones(rows), top_p=jnp.ones(rows), top_k=jnp.zeros(rows, jnp.int32), min_p=jnp.zeros(rows),
            seed=jnp.stack([jnp.zeros(rows, jnp.uint32), jnp.arange(rows, dtype=jnp.uint32)], 1),
            sample_index=jnp.zeros(rows, jnp.int32), step=jnp.full(rows, position, jnp.int32),
            want_logprobs=jnp.zeros(rows, bool), presence_penalty=jnp.zeros(rows), frequency_penalty=jnp.zeros(rows),
            repetition_penalty=jnp.ones(rows), history=jnp.zeros((rows, 1), jnp.int32),
            num_prompt=jnp.zeros(rows, jnp.int32), num_history=jnp.zeros(rows, jnp.int32),
            bias_ids=jnp.zeros((rows, 1), jnp.int32), bias_values=jnp.zeros((rows, 1)),
            logprobs_temperature=jnp.ones(rows), token_bitmask=jnp.full((rows, 1), -1, jnp.int32),
            constrained=jnp.zeros(rows, bool), stop_bitmask=jnp.zeros((rows, 1), jnp.int32),
            masks_stops=jnp.zeros(rows, bool), beam_scores=jnp.zeros(rows, bool))
        logits = jnp.log(jnp.broadcast_to(jnp.asarray(p[position], jnp.float32), (rows, 4)))
        return np.asarray(jax.jit(sample, static_argnums=2)(logits, md, 1).token_ids)

    first, second = stream(0), stream(1)
    outputs = [accepted_tokens(draft, [int(a), int(b)]) for a, b in zip(first, second)]
    counts = np.bincount([o[0] for o in outputs], minlength=4)
    chi2 = ((counts - n * p[0]) ** 2 / (n * p[0])).sum()
    assert chi2 < 16.3                                             # 3 degrees of freedom, p = 0.001
    seconds = [o[1] for o in outputs if len(o) == 2]
    assert abs(len(seconds) - n * p[0][0]) < 4 * np.sqrt(n * p[0][0] * (1 - p[0][0]))
    counts = np.bincount(seconds, minlength=4)
    assert ((counts - len(seconds) * p[1]) ** 2 / (len(seconds) * p[1])).sum() < 16.3
    # Without speculation stream s outputs first[s] and then, after token 0, second[s]: the same.
    assert all(o == ([int(a), int(b)] if a == 0 else [int(a)]) for o, a, b in zip(outputs, first, second))


def test_a_sampled_draft_is_accepted_with_min_1_p_over_q_and_the_output_keeps_the_target_distribution():
    """Speculative sampling's rejection step on a small vocabulary: drafts drawn from q, 4,000
    seeded streams. The output token is distributed as p (chi-square), the draft is kept as often
    as sum min(p, q) says, and with q = p every draft stays."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.sample.sampler import row_key, verify_sampled_draft

    p = np.array([0.5, 0.2, 0.2, 0.1], np.float32)
    q = np.array([0.1, 0.6, 0.1, 0.2], np.float32)
    n = 4000
    drafts = np.random.default_rng(0).choice(4, n, p=q).astype(np.int32)
    keys = jax.vmap(row_key)(jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)], 1),
                             jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32))
    x = jnp.log(jnp.broadcast_to(jnp.asarray(p), (n, 4)))

    def verified(q_rows):
        return np.asarray(jax.jit(verify_sampled_draft)(x, jnp.asarray(drafts), jnp.asarray(q_rows), keys))

    out = verified(np.broadcast_to(q, (n, 4)))
    counts = np.bincount(out, minlength=4)
    assert ((counts - n * p) ** 2 / (n * p)).sum() < 16.3             # 3 degrees of freedom, p = 0.001
    kept = out == drafts
    accept = np.minimum(p, q).sum()                                   # 0.5
    assert abs(kept.sum() - n * accept) < 4 * np.sqrt(n * accept * (1 - accept))
    assert (verified(np.broadcast_to(p, (n, 4))) == drafts).all()


def test_a_stop_string_inside_an_accepted_run_ends_the_output_there_even_if_a_later_token_ended_it():
    """Prompt "abcdab", stop string "da": the first output token is "c", the draft "da" is
    accepted and the step's last token "x" is max_tokens' (or EOS). The stop string came first:
    as without speculation, the tokens end at "cda", the text is "c", and it stopped at "da"."""
    from jaxengine.config import EngineConfig
    from jaxengine.core.scheduler import Scheduler
    from jaxengine.core.scheduler_output import ModelRunnerOutput
    from jaxengine.output_processor import OutputProcessor
    from jaxengine.request import Request, RequestStatus
    from jaxengine.sampling_params import SamplingParams

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    a, b, c, d, x = map(ord, "abcdx")
    for max_tokens, eos in ((4, None), (60, x)):
        cfg = EngineConfig().replace(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                                     enable_prefix_caching=False)
        s = Scheduler(cfg.scheduler, cfg.cache, speculative=SpeculativeConfig(num_speculative_tokens=3,
                                                                             prompt_lookup_min=1))
        s.gate.plan = lambda tokens, rows, proposals, limit=None: [n for n, _ in proposals]
        r = Request("r", [a, b, c, d, a, b], SamplingParams(max_tokens=max_tokens, stop=["da"]), eos_token_id=eos)
        s.add_request(r)
        texts = OutputProcessor(r, Chars(), s.finish_sequence)
        out = s.schedule()
        seq = r.seqs[0]
        n = min(3, max_tokens - 2)                  # the most after the prompt's token and the next one
        assert out.propose == {seq.seq_id: n}
        # The runner proposes after the step what followed "abc" (prompt lookup): "dab".
        s.update_from_output(out, ModelRunnerOutput([[c]], draft_token_ids={seq.seq_id: [d, a, b][:n]}))
        texts.process()
        out = s.schedule()
        assert out.draft_token_ids[seq.seq_id][:2] == [d, a]
        s.update_from_output(out, ModelRunnerOutput([[d, a, x]]))      # d, a accepted; x sampled after them
        texts.process()
        assert texts.final_texts() == ["c"]
        assert (seq.output_token_ids, seq.status, seq.stop_reason) == ([c, d, a], RequestStatus.FINISHED_STOPPED, "da")
        assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def lookup_by_the_rule(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup as its rule reads, one suffix length and one earlier position at a time."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        matched = [e for e in range(n - 1, length - 1) if token_ids[e - n + 1:e + 1] == suffix]
        if matched:
            whole = [e for e in matched if e + k < length]
            start = (whole[-1] if whole else matched[0]) + 1
            return token_ids[start:start + k]
    return []


@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), k=st.integers(0, 5), max_n=st.integers(1, 5),
       min_n=st.integers(1, 3), as_array=st.booleans())
def test_ngram_proposals_follow_the_rule_on_lists_and_on_the_runners_token_rows(tokens, k, max_n, min_n, as_array):
    import numpy as np

    min_n = min(min_n, max_n)
    row = np.asarray(tokens, np.int32) if as_array else tokens
    expected = lookup_by_the_rule(tokens, k, max_n, min_n) if k > 0 and len(tokens) > min_n else []
    assert NgramProposer(k, max_n, min_n).propose(row) == expected
