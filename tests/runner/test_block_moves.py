"""The largest block-move lists the scheduler emits (many forks copying their partial blocks, big
groups swapped out and back in, beam searches forking their beams) run through the real runner on
executables compiled at start-up: nothing compiles while serving."""
import pytest
from hypothesis import example, given, settings, target
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams
from jaxengine.request import RequestStatus
from jaxengine.sampling_params import BeamSearchParams

# A device pool of 47 usable blocks of 4 tokens and a host pool larger than it: forked groups
# of up to 16 sequences outgrow the device pool and are swapped out whole.
ENGINE = dict(skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=16, token_buckets=[16, 64],
              request_buckets=[16], block_size=4, max_model_len=64, num_kv_blocks=48, swap_space=0.0001,
              compile_mode="eager", progress=False)

requests = st.one_of(
    st.tuples(st.just("sample"), st.integers(1, 30), st.integers(1, 16), st.integers(1, 30)),
    st.tuples(st.just("beam"), st.integers(1, 20), st.integers(2, 4), st.integers(2, 6)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("llama-moves")
    make_checkpoint(folder, "llama")
    llm = LLM(folder, **ENGINE)
    assert llm.runner.mover.max_swaps == 47 < llm.config.cache.num_cpu_blocks
    return llm


@pytest.fixture(scope="module")
def moves(llm):
    """The lengths of every move list the runner applies: (kind, number of pairs)."""
    seen, mover = [], llm.runner.mover
    apply = mover.apply

    def recording(kv_caches, swap_out, swap_in, copies):
        seen.extend((kind, len(pairs)) for kind, pairs in (("swap_out", swap_out), ("swap_in", swap_in),
                                                           ("copy", copies)) if pairs)
        return apply(kv_caches, swap_out, swap_in, copies)

    mover.apply = recording
    yield seen
    mover.apply = apply


def run(llm, workload: list[tuple]) -> list:
    added = []
    for i, (kind, prompt_len, width, max_tokens) in enumerate(workload):
        prompt = [(7 * i + 3 * j) % 250 + 1 for j in range(prompt_len)]
        params = (SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
                  if kind == "sample" else BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
        added.append(llm.add_request(f"moves-{i}", prompt, params))
    with llm.runner.forbid_compiles():
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        llm.engine.flush()
    return added


@settings(max_examples=30, deadline=None)
@given(st.lists(requests, min_size=1, max_size=4))
@example([("sample", 30, 8, 30), ("sample", 29, 8, 30)])
@example([("sample", 2, 8, 4), ("sample", 3, 8, 4)])
def test_the_largest_move_lists_run_on_compiled_executables(llm, moves, workload):
    moves.clear()
    added = run(llm, workload)
    assert all(r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) for r in added)
    assert llm.runner.num_compiles == 0
    for kind in ("copy", "swap_out", "swap_in"):
        target(float(max((n for k, n in moves if k == kind), default=0)), label=kind)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.host_pool.num_free_blocks == kv.host_pool.num_blocks


def test_two_full_forks_swap_whole_groups_and_copy_for_every_sequence(llm, moves):
    """Two groups of 8 that outgrow the pool together, then a fork of 16: 15 copies (the last
    sequence writes in place) and swaps of more blocks than a sequence holds."""
    moves.clear()
    run(llm, [("sample", 30, 8, 30), ("sample", 29, 8, 30), ("sample", 3, 16, 4)])
    largest = {kind: max((n for k, n in moves if k == kind), default=0) for kind in ("copy", "swap_out", "swap_in")}
    blocks_per_seq = llm.runner.batch.max_blocks_per_seq
    assert largest["copy"] == 15 and largest["swap_out"] > blocks_per_seq and largest["swap_in"] > blocks_per_seq
    assert llm.runner.num_compiles == 0
