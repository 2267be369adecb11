"""The step executables compiled at start-up cover every step the scheduler can make, and the
guard sees a real compilation (JAX's own compile events confirm it, no counter is faked)."""
import logging

import pytest
from jax import monitoring

from jaxengine import LLM, SamplingParams
from jaxengine.runner.model_runner import CompilationError

LOWERINGS = []    # JAX reports each lowering to XLA (cache hit or not) under this event
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: LOWERINGS.append(event) if event.endswith("jaxpr_to_mlir_module_duration") else None)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("llama-compiles")
    make_checkpoint(folder, "llama")
    # The default block size: 64 tokens are 4 blocks a sequence, fewer than a fork of 32 copies.
    return LLM(folder, skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=32, max_model_len=64,
               num_kv_blocks=160, swap_space=0.002, progress=False, compile_mode="eager")


def test_eager_start_up_compiles_every_token_and_row_bucket_and_block_move(llm):
    runner = llm.runner
    assert runner.token_buckets == [1, 2, 4, 8, 16, 32, 64] and runner.request_buckets == [1, 2, 4, 8, 16, 32]
    # Below 8 tokens the rows pad like the tokens; from 8 tokens to at least 8 rows, and never
    # more rows than tokens: 12 of the 42 combinations.
    assert sorted(runner._executables) == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (16, 16), (32, 8), (32, 16),
                                           (32, 32), (64, 8), (64, 16), (64, 32)]
    assert runner.step_limits() == (64, 32) and not runner.is_compiling and runner.wait_until_compiled(0)
    host_blocks = llm.config.cache.num_cpu_blocks
    assert host_blocks > 160                      # the device pool bounds the swaps: 159 blocks
    swaps = [1, 4, 16, 64, 159]
    assert runner.mover.buckets == {"copy": [1, 4, 16, 32], "swap_out": swaps, "swap_in": swaps}
    assert sorted(runner.mover._executables) == sorted(
        [("copy", n) for n in (1, 4, 16, 32)] + [(kind, n) for kind in ("swap_out", "swap_in") for n in swaps])


def test_a_fork_of_32_copying_its_partial_block_compiles_nothing(llm, monkeypatch):
    """One 3-token prompt with n = 32: the first decode copies the shared partial block for 31
    of the 32 sequences (the last writes in place), a copy list longer than 4 sequences' blocks."""
    copies, apply = [], llm.runner.mover.apply

    def recording(kv_caches, swap_out, swap_in, to_copy):
        copies.append(len(to_copy))
        return apply(kv_caches, swap_out, swap_in, to_copy)

    monkeypatch.setattr(llm.runner.mover, "apply", recording)
    before = len(LOWERINGS)
    with llm.runner.forbid_compiles():
        out = llm.generate([[5, 6, 7]], SamplingParams(n=32, temperature=1.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs) == 32 and all(1 <= len(c.token_ids) <= 4 for c in out[0].outputs)
    assert max(copies) > 4 * llm.runner.batch.max_blocks_per_seq
    assert llm.runner.num_compiles == 0 and len(LOWERINGS) == before


def test_the_step_donates_the_kv_caches(llm):
    caches = llm.runner.kv_caches
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert all(c.is_deleted() for c in caches) and not any(c.is_deleted() for c in llm.runner.kv_caches)


def test_a_step_without_executable_compiles_once_and_is_logged(llm, caplog):
    """A runner started without compiling (its own step function: nothing cached in memory)."""
    cold = LLM(llm.model_path, skip_tokenizer_init=True, max_num_batched_tokens=16, max_num_seqs=8, block_size=4,
               max_model_len=64, num_kv_blocks=40, swap_space=0, progress=False, warm_up=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = len(LOWERINGS)
    with caplog.at_level(logging.WARNING):
        first = cold.generate([[7, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert cold.runner.num_compiles == 2 and len(LOWERINGS) == before + 2          # the prompt's step, a decode's
    assert list(cold.runner._executables) == [(4, 4), (1, 1)]
    assert "compilation after start-up (step bucket (4, 4)); 1 so far" in caplog.text
    assert "compilation after start-up (step bucket (1, 1)); 2 so far" in caplog.text
    assert cold.generate([[7, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert cold.runner.num_compiles == 2 and len(LOWERINGS) == before + 2          # compiled once, then reused
    assert llm.generate([[7, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids == first


def test_inside_forbid_compiles_a_step_without_executable_is_refused(llm):
    """Last in this module: the refused step leaves its request unfinished."""
    del llm.runner._executables[(4, 4)]            # a bucket set left incomplete
    before = len(LOWERINGS)
    with llm.runner.forbid_compiles(), pytest.raises(CompilationError, match=r"step bucket \(4, 4\)"):
        llm.generate([[7, 8, 9]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert llm.runner.num_compiles == 0 and len(LOWERINGS) == before                # refused before compiling


def test_block_moves_beyond_the_compiled_sizes_compile_once_and_are_told():
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.runner.kv_cache import BlockMover

    told = []
    mover = BlockMover(16, 4, [(3, 1, 5)] * 2, 2, jnp.float32, max_num_seqs=2, on_compile=told.append)
    caches = tuple(jnp.arange(2 * 16 * 15, dtype=jnp.float32).reshape(2, 16, 3, 1, 5) + i for i in range(2))
    assert mover.compile_all(caches) == 2 + 2 + 2           # copies of 1, 2; swaps of 1, 4 blocks each way
    before = len(LOWERINGS)
    caches = mover.apply(caches, [], [], [(1, 9)])                   # one pair: compiled at start-up
    assert told == [] and len(LOWERINGS) == before
    expected = [np.array(c) for c in caches]
    for e in expected:
        e[:, [10, 11, 12]] = e[:, [2, 3, 4]]
    caches = mover.apply(caches, [], [], [(2, 10), (3, 11), (4, 12)])  # more than a step can copy: padded to 4
    assert told == ["block copy of 4"] and len(LOWERINGS) > before
    assert all((np.asarray(c) == e).all() for c, e in zip(caches, expected))
    lowered = len(LOWERINGS)
    mover.apply(caches, [], [], [(2, 10), (3, 11), (4, 12)])
    assert told == ["block copy of 4"] and len(LOWERINGS) == lowered


def test_without_a_host_pool_no_swap_is_compiled():
    import jax.numpy as jnp

    from jaxengine.runner.kv_cache import BlockMover, max_block_moves

    assert max_block_moves(num_gpu_blocks=100, num_cpu_blocks=500, max_num_seqs=64) == (64, 99)
    assert max_block_moves(num_gpu_blocks=40, num_cpu_blocks=0, max_num_seqs=64) == (39, 0)
    mover = BlockMover(16, 0, [(3, 1, 5)] * 2, 2, jnp.float32, max_num_seqs=8)
    caches = tuple(jnp.zeros((2, 16, 3, 1, 5)) for _ in range(2))
    assert mover.compile_all(caches) == 3 and sorted(mover._executables) == [("copy", n) for n in (1, 4, 8)]


def test_move_lists_longer_than_a_chunk_go_in_several_compiled_moves(monkeypatch):
    import jax.numpy as jnp
    import numpy as np

    from jaxengine.runner import kv_cache
    from jaxengine.runner.kv_cache import BlockMover, move_buckets

    assert move_buckets(0) == [] and move_buckets(1) == [1] and move_buckets(5) == [1, 4, 5]
    assert move_buckets(159) == [1, 4, 16, 64, 159] and move_buckets(10_000) == [1, 4, 16, 64, 256]
    monkeypatch.setattr(kv_cache, "MOVE_CHUNK", 4)
    told = []
    mover = BlockMover(20, 12, [(3, 1, 5)] * 2, 2, jnp.float32, max_num_seqs=8, on_compile=told.append)
    assert mover.buckets == {"copy": [1, 4], "swap_out": [1, 4], "swap_in": [1, 4]}
    caches = tuple(jnp.arange(2 * 20 * 15, dtype=jnp.float32).reshape(2, 20, 3, 1, 5) + 1000 * i for i in range(2))
    mover.compile_all(caches)
    expected = [np.array(c) for c in caches]
    out = [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)]                    # 6 blocks to host blocks 0-5
    back = [(h, d + 6) for d, h in out]                                        # and back into blocks 7-12
    caches = mover.apply(caches, out, [], [])
    caches = mover.apply(caches, [], back, [(s, s + 12) for s in range(1, 7)])     # 6 copies: 4, then 2
    for e in expected:
        e[:, 7:13] = e[:, 1:7]
        e[:, 13:19] = e[:, 1:7]
    assert all((np.asarray(c)[:, 1:] == e[:, 1:]).all() for c, e in zip(caches, expected))
    assert told == []                                                          # every chunk compiled at start-up
