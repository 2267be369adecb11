"""Exact-value scenarios for the scheduler. Block size 4 unless said; {request: tokens} per step."""
import pytest

from jaxengine.request import Request, RequestStatus
from jaxengine.sampling_params import SamplingParams

from tests.helpers import Clock, Harness


def unconstrained_outputs(spec, **overrides):
    """The same requests on a pool and budget large enough that nothing is ever preempted."""
    h = Harness(num_gpu_blocks=256, max_num_batched_tokens=256, **overrides)
    for args, kwargs in spec:
        h.add(*args, **kwargs)
    h.run()
    return h.outputs()


def test_budget_goes_to_decodes_first_and_a_chunked_prefill_gets_the_rest():
    h = Harness(max_num_batched_tokens=8)
    h.add("r0", 3, max_tokens=10)
    h.add("r1", 3, max_tokens=10)
    h.add("r2", 20, max_tokens=10)
    assert h.step() == {"r0": 3, "r1": 3, "r2": 2}
    assert h.step() == {"r0": 1, "r1": 1, "r2": 6}
    assert h.step() == {"r0": 1, "r1": 1, "r2": 6}
    assert h.step() == {"r0": 1, "r1": 1, "r2": 6}      # r2's prompt completes: it samples
    assert h.requests["r2"].output_token_ids and len(h.requests["r2"].output_token_ids) == 1
    assert h.step() == {"r0": 1, "r1": 1, "r2": 1}
    assert (h.last.num_decode_tokens, h.last.num_prefill_tokens) == (3, 0)


def test_a_partial_prefill_admitted_first_still_waits_for_the_decodes():
    h = Harness(max_num_batched_tokens=8, long_prefill_token_threshold=6)
    h.add("long", 20, max_tokens=4)
    h.add("short", 2, max_tokens=4)
    assert h.step() == {"long": 6, "short": 2}
    h.add("tiny", 1, max_tokens=4)
    assert h.step() == {"short": 1, "long": 6, "tiny": 1}
    assert [s.request.request_id for s in h.last.scheduled_seqs] == ["short", "long", "tiny"]


@pytest.mark.parametrize("max_partial, expected", [
    (1, [{"r0": 5}, {"r0": 5}, {"r0": 2, "r1": 5}, {"r0": 1, "r1": 5}, {"r0": 1, "r1": 2}]),
    (2, [{"r0": 5, "r1": 5}, {"r0": 5, "r1": 5}, {"r0": 2, "r1": 2}]),
])
def test_long_prefill_threshold_and_max_partial_prefills(max_partial, expected):
    h = Harness(max_num_batched_tokens=16, long_prefill_token_threshold=5, max_num_partial_prefills=max_partial)
    h.add("r0", 12)
    h.add("r1", 12)
    assert [h.step() for _ in expected] == expected


def test_max_num_seqs_caps_the_batch_and_counts_every_sample_of_a_group():
    h = Harness(max_num_seqs=2)
    for rid in ("r0", "r1", "r2"):
        h.add(rid, 4, max_tokens=2)
    assert [h.step() for _ in range(3)] == [{"r0": 4, "r1": 4}, {"r0": 1, "r1": 1}, {"r2": 4}]
    h = Harness(max_num_seqs=2)
    h.add("g", 4, max_tokens=2, n=2)
    h.add("r", 4, max_tokens=2)
    assert [h.step() for _ in range(3)] == [{"g": 4}, {"g": 2}, {"r": 4}]


PRESSURE = [(("r0", 4), dict(max_tokens=20)), (("r1", 4), dict(max_tokens=20)), (("r2", 4), dict(max_tokens=20))]


def test_fcfs_preempts_the_last_admitted_by_recompute_and_it_resumes_with_its_output():
    h = Harness(num_gpu_blocks=7)                        # 6 usable blocks
    for args, kwargs in PRESSURE:
        h.add(*args, **kwargs)
    for _ in range(5):
        assert h.step() == {"r0": 1, "r1": 1, "r2": 1} or h.last.num_prefill_tokens == 12
    r2 = h.requests["r2"]
    kept = list(r2.output_token_ids)
    assert len(kept) == 5
    assert h.step() == {"r0": 1, "r1": 1}                # position 8 needs a third block each
    assert r2.status is RequestStatus.PREEMPTED and r2.num_preemptions == 1
    assert h.last.preempted_seq_ids == [r2.seqs[0].seq_id] and h.last.num_preemptions == 1
    assert h.scheduler.waiting.peek() is r2 and r2.seqs[0].block_table == []
    assert r2.output_token_ids == kept                   # output kept for the resume
    resumed = []
    while r2.status is not RequestStatus.RUNNING:
        resumed = h.step().get("r2")
    assert resumed == 9                                  # prompt + 5 kept outputs recomputed
    h.run()
    assert h.outputs() == unconstrained_outputs(PRESSURE)


def test_priority_preempts_the_lowest_priority_not_the_last_admitted():
    h = Harness(num_gpu_blocks=7, policy="priority")
    h.add("low", 4, max_tokens=20, priority=1, arrival=0.0)
    assert h.step() == {"low": 4}
    h.add("a", 4, max_tokens=20, arrival=1.0)
    h.add("b", 4, max_tokens=20, arrival=2.0)
    assert h.step() == {"low": 1, "a": 4, "b": 4}
    while h.last.num_preemptions == 0:
        h.step()
    assert h.requests["low"].status is RequestStatus.PREEMPTED
    assert scheduled(h) == {"a": 1, "b": 1}


def scheduled(h):
    from tests.helpers import scheduled_by_request
    return scheduled_by_request(h.last)


def test_a_higher_priority_arrival_preempts_a_lower_priority_running_request():
    h = Harness(num_gpu_blocks=9, policy="priority")    # 8 usable
    h.add("bulk", 20, max_tokens=8, priority=5)          # 5 blocks
    assert h.step() == {"bulk": 20}
    h.add("vip", 16, max_tokens=2, priority=0)           # needs 4 blocks, 3 free
    assert h.step() == {}                                # preempted for vip; no admission this step
    assert h.requests["bulk"].status is RequestStatus.PREEMPTED
    assert h.step() == {"vip": 16}
    h.run()
    assert h.requests["bulk"].num_preemptions == 1
    assert h.outputs()["bulk"] == unconstrained_outputs([(("bulk", 20), dict(max_tokens=8))])["bulk"]
    fcfs = Harness(num_gpu_blocks=9)
    fcfs.add("bulk", 20, max_tokens=8, priority=5)
    fcfs.step()
    fcfs.add("vip", 16, max_tokens=2, priority=0)
    assert fcfs.step() == {"bulk": 1}                    # fcfs: vip simply waits


STARVE = dict(num_gpu_blocks=13, num_cpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=8,
              policy="priority", watermark=0.0)


@pytest.mark.parametrize("mode, g_tokens", [("auto", 9), ("recompute", 2)])
def test_a_group_preempted_for_a_better_request_does_not_come_back_before_it(mode, g_tokens):
    """G (n=2) is preempted for H; swapped or recomputed, it waits until H has run. Its samples
    then outgrow the 12-block pool and end by length with their tokens."""
    h = Harness(preemption_mode=mode, **STARVE)
    g = h.add("G", 32, max_tokens=40, n=2, priority=5)
    assert h.step() == {"G": 16}
    vip = h.add("H", 40, max_tokens=8, priority=0)
    steps, moved, vip_done = [], 0, None
    while h.scheduler.has_unfinished_requests():
        steps.append(h.step())
        moved += len(h.last.blocks_to_swap_in) + len(h.last.blocks_to_swap_out)
        vip_done = vip_done or (vip.is_finished and len(steps))
    assert steps[:4] == [{"G": 16}, {"G": 2}, {}, {"H": 16}]     # preempted in the 3rd step, H runs in the 4th
    assert steps[3:vip_done] == [{"H": 16}, {"H": 16}, {"H": 8}] + [{"H": 1}] * 7
    assert steps[vip_done:] == ([{"G": 2}] * 7 + [{}] if mode == "auto" else [])   # then G resumes, or ends
    assert g.num_preemptions == 1 and moved == (20 if mode == "auto" else 0)    # 10 blocks out, 10 in
    assert g.status is RequestStatus.FINISHED_LENGTH and g.status.finish_reason == "length"
    assert h.requests["H"].status is RequestStatus.FINISHED_LENGTH
    unconstrained = unconstrained_outputs([(("G", 32), dict(max_tokens=40, n=2, priority=5))])["G"]
    assert h.outputs()["G"] == [out[:g_tokens] for out in unconstrained]


SWAP = [(("r", 4), dict(max_tokens=8)), (("g", 4), dict(max_tokens=8, n=2))]


def test_swap_out_and_in_move_free_counts_by_exactly_the_swapped_blocks():
    h = Harness(num_gpu_blocks=7, num_cpu_blocks=8)
    for args, kwargs in SWAP:
        h.add(*args, **kwargs)
    for _ in range(5):
        h.step()
    assert (h.kv.num_free_blocks, h.kv.host_pool.num_free_blocks) == (1, 8)
    assert h.step() == {"r": 1}                          # g cannot grow: swapped out whole
    g = h.requests["g"]
    assert g.status is RequestStatus.SWAPPED and h.scheduler.swapped == [g]
    assert len(h.last.blocks_to_swap_out) == 3           # shared prompt block + one block per sample
    assert (h.kv.num_free_blocks, h.kv.host_pool.num_free_blocks) == (1 - 1 + 3, 8 - 3)
    h.add("q", 2, max_tokens=2)                          # would fit, but swapped groups go first
    assert h.step() == {"r": 1}
    assert h.step() == {"r": 1}                          # r finishes: 3 blocks back
    assert h.kv.num_free_blocks == 6
    assert h.step() == {"g": 2, "q": 2}
    assert len(h.last.blocks_to_swap_in) == 3
    assert h.kv.host_pool.num_free_blocks == 8
    assert h.kv.num_free_blocks == 6 - 3 - 2 - 1         # swapped in, two new decode blocks, q
    h.run()
    assert h.outputs() == unconstrained_outputs(SWAP + [(("q", 2), dict(max_tokens=2))])


def test_recompute_mode_for_a_group_and_swap_mode_for_a_single_sequence():
    for mode in ("recompute", "swap"):
        h = Harness(num_gpu_blocks=7, num_cpu_blocks=8, preemption_mode=mode)
        for args, kwargs in SWAP:
            h.add(*args, **kwargs)
        h.run()
        assert sum(r.num_preemptions for r in h.requests.values()) >= 1
        assert h.outputs() == unconstrained_outputs(SWAP)
        assert (h.kv.num_free_blocks, h.kv.host_pool.num_free_blocks) == (6, 8)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    h = Harness(num_gpu_blocks=7, num_cpu_blocks=2)
    for args, kwargs in SWAP:
        h.add(*args, **kwargs)
    for _ in range(6):
        h.step()
    assert h.requests["g"].status is RequestStatus.PREEMPTED and h.last.blocks_to_swap_out == []
    assert (h.last.num_preemptions, h.last.num_swap_fallbacks) == (1, 1)
    h.run()
    assert h.outputs() == unconstrained_outputs(SWAP)
    swapping = Harness(num_gpu_blocks=7, num_cpu_blocks=8)
    off = Harness(num_gpu_blocks=7, num_cpu_blocks=0)   # no host pool: swapping is off, not full
    for harness in (swapping, off):
        for args, kwargs in SWAP:
            harness.add(*args, **kwargs)
        fallbacks = 0
        while harness.scheduler.has_unfinished_requests():
            harness.step()
            fallbacks += harness.last.num_swap_fallbacks
        assert fallbacks == 0 and sum(r.num_preemptions for r in harness.requests.values()) >= 1


def test_watermark_refuses_an_admission_that_would_eat_the_reserve():
    h = Harness(num_gpu_blocks=11, watermark=0.2)        # 10 usable, 2 kept free
    h.add("r0", 16, max_tokens=2)                        # 4 blocks
    h.add("r1", 20, max_tokens=2)                        # 5 more would leave 1 < 2
    assert h.step() == {"r0": 16}
    assert h.step() == {"r0": 1}                         # r0 finishes
    assert h.step() == {"r1": 20}
    alone = Harness(num_gpu_blocks=11, watermark=0.2)
    alone.add("big", 36, max_tokens=1)                   # 9 blocks: the reserve is moot when idle
    assert alone.step() == {"big": 36}


def test_delay_factor_holds_new_prompts_while_others_run():
    clock = Clock(0.0)
    h = Harness(clock, delay_factor=1.0)
    h.add("r0", 4, max_tokens=50)
    assert h.step() == {"r0": 4}                         # nothing runs: no delay
    clock.now = 10.0
    assert h.step() == {"r0": 1}                         # the prompt step took 10 s
    clock.now = 12.0
    h.add("r1", 4, max_tokens=2)
    clock.now = 15.0
    assert h.step() == {"r0": 1}                         # waited 3 s < 1.0 x 10 s
    clock.now = 23.0
    assert h.step() == {"r0": 1, "r1": 4}                # waited 11 s


def test_requests_that_can_never_fit_finish_at_once_with_a_reason():
    h = Harness(num_gpu_blocks=7, max_model_len=30)      # 24 tokens of pool
    h.add("ok", 4, max_tokens=2)
    long = h.add("too-long", 31)
    big = h.add("too-big", 25)
    assert long.status is RequestStatus.FINISHED_IGNORED and "max_model_len=30" in long.status_reason
    assert big.status is RequestStatus.FINISHED_IGNORED and "pool holds (24 tokens)" in big.status_reason
    assert h.step() == {"ok": 4}
    assert {r.request_id for r in h.finished} == {"too-long", "too-big"}
    nochunk = Harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    r = nochunk.add("r", 9)
    assert r.status is RequestStatus.FINISHED_IGNORED and "chunked prefill disabled" in r.status_reason
    wide = h.add("wide", 2, n=9)                         # more samples than max_num_seqs=8 could ever run
    assert wide.status is RequestStatus.FINISHED_IGNORED and "max_num_seqs=8" in wide.status_reason


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_sequence_that_outgrows_the_whole_pool_ends_by_length_with_its_tokens(async_scheduling):
    h = Harness(num_gpu_blocks=3, async_scheduling=async_scheduling)    # 2 usable blocks: 8 tokens
    r = h.add("r", 4, max_tokens=20)
    h.run()
    assert r.status is RequestStatus.FINISHED_LENGTH and r.status.finish_reason == "length"
    expected = unconstrained_outputs([(("r", 4), dict(max_tokens=20))])["r"][0]
    assert r.output_token_ids == expected[:5]            # positions 0-7 computed, the 5th token sampled
    assert h.kv.num_free_blocks == 2


def test_a_swapped_group_that_cannot_come_back_to_the_empty_pool_ends_by_length_with_its_tokens():
    spec = [(("r", 1), dict(max_tokens=5)), (("g", 5), dict(max_tokens=10, n=2))]
    h = Harness(num_gpu_blocks=5, num_cpu_blocks=16)    # 4 usable blocks
    for args, kwargs in spec:
        h.add(*args, **kwargs)
    g = h.requests["g"]
    steps = [h.step() for _ in range(5)]
    assert steps == [{"r": 1, "g": 5}] + [{"r": 1, "g": 2}] * 3 + [{"r": 1}]
    assert g.status is RequestStatus.SWAPPED            # no room to grow: swapped out; r finishes
    assert h.requests["r"].status is RequestStatus.FINISHED_LENGTH
    h.run()
    assert g.status is RequestStatus.FINISHED_LENGTH and g.num_preemptions == 1
    assert "whole pool" in g.status_reason
    assert [s.status for s in g.seqs] == [RequestStatus.FINISHED_LENGTH] * 2
    assert h.outputs()["g"] == [out[:4] for out in unconstrained_outputs(spec)["g"]]
    assert (h.kv.num_free_blocks, h.kv.host_pool.num_free_blocks) == (4, 16)


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits_it_whole():
    h = Harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    h.add("a", 6, max_tokens=3)
    h.add("b", 6, max_tokens=3)
    assert h.step() == {"a": 6}
    assert h.step() == {"a": 1, "b": 6}


def test_abort_frees_every_block_wherever_the_request_is():
    h = Harness(num_gpu_blocks=7, num_cpu_blocks=8)
    for args, kwargs in SWAP:
        h.add(*args, **kwargs)
    h.add("waiting", 4)
    for _ in range(6):
        h.step()
    assert h.requests["g"].status is RequestStatus.SWAPPED
    assert h.scheduler.abort("g") and h.scheduler.abort("r") and h.scheduler.abort("waiting")
    assert not h.scheduler.abort("g") and not h.scheduler.abort("unknown")
    assert (h.kv.num_free_blocks, h.kv.host_pool.num_free_blocks) == (6, 8)
    assert h.step() == {}
    assert {r.request_id: r.status for r in h.finished} == {
        rid: RequestStatus.FINISHED_ABORTED for rid in ("g", "r", "waiting")}
    assert not h.scheduler.has_unfinished_requests()
    assert sorted(h.last.finished_seq_ids) == sorted(s.seq_id for r in h.requests.values() for s in r.seqs)


def test_duplicate_request_ids_are_refused():
    h = Harness()
    h.add("x", 3)
    with pytest.raises(ValueError, match="request_id: 'x' is already in use"):
        h.add("x", 3)


def test_step_limits_cap_the_budget_and_the_sequences_and_lifting_them_goes_on():
    """A runner still compiling gives smaller limits: a long prompt is chunked to them, a group
    wider than them waits (never refused: the configured limits hold it), and with the
    configured limits back the same requests finish as they would have."""
    from jaxengine.core.scheduler_output import StepLimits

    spec = [(("long", 20), dict(max_tokens=3)), (("a", 3), dict(max_tokens=3)), (("wide", 3), dict(max_tokens=3, n=4))]
    h = Harness(max_num_batched_tokens=64, max_num_seqs=8)
    h.runner.step_limits = lambda: StepLimits(8, 2)
    for args, kwargs in spec:
        h.add(*args, **kwargs)
    for _ in range(12):
        h.step()
        assert sum(h.last.num_scheduled_tokens) <= 8 and len(h.last.seq_ids) <= 2
    assert h.requests["long"].is_finished and h.requests["a"].is_finished
    assert h.requests["wide"].status is RequestStatus.WAITING                   # 4 samples > 2 rows
    h.runner.step_limits = lambda: StepLimits(64, 8)
    h.run()
    assert h.outputs() == unconstrained_outputs(spec)


def test_without_chunking_a_prompt_longer_than_the_step_limit_waits_for_it():
    from jaxengine.core.scheduler_output import StepLimits

    h = Harness(max_num_batched_tokens=32, enable_chunked_prefill=False)
    h.runner.step_limits = lambda: StepLimits(16, 8)
    h.add("long", 20, max_tokens=2)
    assert h.step() == {} and h.requests["long"].status is RequestStatus.WAITING
    h.runner.step_limits = lambda: StepLimits(32, 8)
    assert h.step() == {"long": 20}


def test_priority_preemption_counts_sequences_against_the_step_limit():
    from jaxengine.core.scheduler_output import StepLimits

    h = Harness(policy="priority", max_num_seqs=8)
    h.runner.step_limits = lambda: StepLimits(64, 2)
    h.add("low", 4, max_tokens=20, priority=5)
    h.add("low2", 4, max_tokens=20, priority=5)
    assert h.step() == {"low": 4, "low2": 4}
    h.add("vip", 4, max_tokens=2, priority=0)                   # a third sequence: over the limit of 2
    assert h.step() == {"low": 1} and h.last.num_preemptions == 1
    assert h.step() == {"low": 1, "vip": 4}


def test_priority_preempts_nothing_for_a_group_wider_than_the_step_limit():
    """A better group with more samples than this step's rows cannot start until the limit
    grows: preempting for it would only throw away the others' KV."""
    from jaxengine.core.scheduler_output import StepLimits

    h = Harness(policy="priority", max_num_seqs=8)
    h.runner.step_limits = lambda: StepLimits(64, 2)
    h.add("low", 4, max_tokens=20, priority=5)
    assert h.step() == {"low": 4}
    h.add("wide", 4, max_tokens=2, priority=0, n=4)                 # 4 samples > 2 rows
    for _ in range(3):
        assert h.step() == {"low": 1} and h.last.num_preemptions == 0
    h.runner.step_limits = lambda: StepLimits(64, 8)
    h.step()
    assert h.requests["wide"].status is RequestStatus.RUNNING


class RecordingGrammar:
    """A grammar that allows every token and records those it is fed."""

    def __init__(self, accepted=()) -> None:
        self.accepted, self.is_done = list(accepted), False

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    def fill(self, row) -> None:
        pass

    def copy(self) -> "RecordingGrammar":
        return RecordingGrammar(self.accepted)


def test_a_grammar_group_swapped_out_by_the_step_run_ahead_samples_its_token_again():
    """Async scheduling: grammar rows get no placeholder, so the step launched ahead may swap the
    group out while its own step runs. That step's tokens are dropped and computed again once the
    group is back: it finishes with the tokens of a synchronous run, each fed to its grammar once."""
    import types

    from jaxengine.sampling_params import StructuredOutputsParams

    def run(async_scheduling: bool):
        h = Harness(async_scheduling=async_scheduling, num_gpu_blocks=7, num_cpu_blocks=8)
        h.engine.structured.compiler = types.SimpleNamespace(vocab_size=1024)    # for the step's bitmask
        h.add("r", 4, max_tokens=8)
        g = h.add("g", 4, max_tokens=8, n=2, structured_outputs=StructuredOutputsParams(regex="a+"))
        g.seqs[0].grammar = RecordingGrammar()
        swapped = 0
        for _ in range(100):
            if not h.scheduler.has_unfinished_requests():
                break
            h.step()
            swapped += len(h.last.blocks_to_swap_out)
        assert not h.scheduler.has_unfinished_requests()
        return h.outputs(), [s.grammar.accepted for s in g.seqs], swapped

    outputs, fed, swapped = run(async_scheduling=True)
    assert swapped > 0
    assert outputs == run(async_scheduling=False)[0]
    assert all(len(o) == 8 for o in outputs["g"])
    assert fed == [o[:-1] for o in outputs["g"]]          # the token that ends it by length is not fed


def test_a_request_whose_adapter_would_pass_max_loras_waits_and_nothing_overtakes_it():
    """max_loras 1: adapter 1 runs; a request of adapter 2 waits at the head, and a later request
    of the running adapter 1 waits behind it (else adapter 1 could hold the slot for ever); once
    adapter 1's request ends, adapter 2's goes first."""
    from jaxengine.config import LoRAConfig
    from jaxengine.lora_request import LoRARequest

    h = Harness(lora=LoRAConfig(max_loras=1))

    def add(request_id: str, adapter: int, max_tokens: int) -> None:
        request = Request(request_id, [100 + adapter] * 5, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          arrival_time=h.clock(), lora_request=LoRARequest(f"a{adapter}", adapter, "unread"),
                          lora_digest=f"d{adapter}")
        h.requests[request_id] = request
        h.scheduler.add_request(request)

    add("first", 1, 3)
    add("other", 2, 3)
    add("same", 1, 3)
    assert h.step() == {"first": 5}
    assert h.step() == {"first": 1} and h.step() == {"first": 1}
    assert h.step() == {"other": 5}                  # adapter 1 has ended: the head goes
    assert h.step() == {"other": 1} and h.step() == {"other": 1}
    assert h.step() == {"same": 5}
