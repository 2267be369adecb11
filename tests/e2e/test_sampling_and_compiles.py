"""Seeded sampling, the compile guard over a randomised workload, and clean shutdown of state."""
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams


@pytest.fixture(scope="module")
def hf_and_llm(tmp_path_factory):
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("llama-sampling")
    hf = make_checkpoint(folder, "llama")
    return hf, LLM(folder, skip_tokenizer_init=True, max_num_batched_tokens=32, max_num_seqs=8, block_size=4,
                   async_scheduling=True,
                   max_model_len=64, num_kv_blocks=40, swap_space=0.002, progress=False, compile_mode="eager")


@pytest.fixture(scope="module")
def llm(hf_and_llm):
    return hf_and_llm[1]


PROMPT = [5, 17, 99, 3, 42]


def tokens(llm, **params):
    outs = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, **params), use_tqdm=False)
    return [c.token_ids for c in outs[0].outputs]


def test_seeded_sampling_reproduces_and_seeds_and_samples_differ(llm):
    a = tokens(llm, temperature=1.0, seed=7)
    assert tokens(llm, temperature=1.0, seed=7) == a
    assert tokens(llm, temperature=1.0, seed=8) != a
    group = tokens(llm, temperature=1.0, seed=7, n=3)
    assert group[0] == a[0] and len({tuple(t) for t in group}) == 3     # sample 0 is seed 7's stream


def test_all_64_bits_of_a_seed_count_and_negative_seeds_work(llm):
    a = tokens(llm, temperature=1.0, seed=7)
    high = tokens(llm, temperature=1.0, seed=7 + (1 << 32))            # the same low 32 bits
    assert high != a and tokens(llm, temperature=1.0, seed=7 + (1 << 32)) == high
    negative = tokens(llm, temperature=1.0, seed=-7)
    assert negative not in (a, high) and tokens(llm, temperature=1.0, seed=-7) == negative
    extremes = [tokens(llm, temperature=1.0, seed=s) for s in (-(1 << 63), (1 << 63) - 1)]
    assert extremes[0] != extremes[1] and all(len(t[0]) == 12 for t in extremes)


def test_a_seed_below_2_to_the_32_keeps_its_stream():
    import jax
    import jax.numpy as jnp

    from jaxengine.runner.input_batch import seed_words
    from jaxengine.sample.sampler import row_key

    for seed in (0, 7, (1 << 32) - 1):
        ours = row_key(jnp.asarray(seed_words(seed), jnp.uint32), 2, 5)
        plain = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 2), 5)
        assert jax.random.key_data(ours).tolist() == jax.random.key_data(plain).tolist()
    assert seed_words(-1) == (0xFFFFFFFF, 0xFFFFFFFF) and seed_words(-(1 << 63)) == (0x80000000, 0)


def test_a_request_stream_does_not_depend_on_its_batch(llm):
    alone = tokens(llm, temperature=0.9, top_p=0.9, top_k=20, seed=3)
    others = [[random.Random(i).randrange(256) for _ in range(9)] for i in range(5)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=20, seed=3)]
    params += [SamplingParams(max_tokens=7, temperature=1.0, seed=i) for i in range(5)]
    outs = llm.generate(others[:2] + [PROMPT] + others[2:], params[1:3] + params[:1] + params[3:], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone[0]


def test_top_k_1_is_greedy_and_logprobs_are_consistent(llm):
    greedy = tokens(llm, temperature=0)
    assert tokens(llm, temperature=2.0, top_k=1, seed=1) == greedy
    outs = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True),
                        use_tqdm=False)
    c = outs[0].outputs[0]
    assert len(c.logprobs) == 5 and all(len(top) == 3 for top in c.logprobs)
    for token, top in zip(c.token_ids, c.logprobs):
        assert max(top, key=top.get) == token                         # greedy: the most likely token
    assert c.cumulative_logprob == pytest.approx(sum(top[t] for t, top in zip(c.token_ids, c.logprobs)))


def test_no_compilation_after_start_up_over_a_randomised_workload(llm):
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(240):
        prompts.append([rng.randrange(256) for _ in range(rng.randint(1, 40))])
        params.append(SamplingParams(
            max_tokens=rng.randint(1, 20), n=rng.choice([1, 1, 1, 2, 3]), temperature=rng.choice([0, 0.7, 1.3]),
            top_p=rng.choice([1.0, 0.8]), top_k=rng.choice([0, 5]), min_p=rng.choice([0.0, 0.1]),
            seed=rng.choice([None, i]), stop_token_ids=rng.choice([[], [rng.randrange(256)]]),
            logprobs=rng.choice([None, 2])))
    llm.engine.traces = []
    with llm.runner.forbid_compiles():
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_compiles == 0
    assert sum(t.num_preemptions for t in llm.engine.traces) > 0           # the small pool was exercised
    for o, p in zip(outs, params):
        assert len(o.outputs) == p.n and all(1 <= len(c.token_ids) <= p.max_tokens for c in o.outputs)
        assert all(c.finish_reason in ("stop", "length") for c in o.outputs)
    sched = llm.engine.scheduler
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    assert sched.kv.host_pool.num_free_blocks == sched.kv.host_pool.num_blocks
    assert not sched.has_unfinished_requests() and not llm.runner.batch.slot_of


def test_bad_input_is_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match=r"prompt_token_ids: \[300\] outside the vocabulary of 256 tokens"):
        llm.generate([[1, 2], [300]], use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds the maximum context length of 64 tokens"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="text needs a tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs: must be None or in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[999\] outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={999: 1.0}), use_tqdm=False)
    assert not llm.engine.scheduler.has_unfinished_requests()
    assert np.all(llm.runner.batch.num_logprobs >= -1)


def penalised_greedy(hf, prompt, num_tokens, penalty):
    """The oracle: transformers' logits, and the repetition penalty by its definition (every token
    of the prompt and the output so far: positive logits divided, negative ones multiplied)."""
    import torch

    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            seen = torch.tensor(sorted(set(ids)))
            logits[seen] = torch.where(logits[seen] < 0, logits[seen] * penalty, logits[seen] / penalty)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_repetition_penalty_matches_its_definition_on_transformers_logits(hf_and_llm):
    hf, llm = hf_and_llm
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    refs = [penalised_greedy(hf, p, 16, 3.0) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with llm.runner.forbid_compiles():
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                   repetition_penalty=3.0), use_tqdm=False)
        plain = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == refs
    assert sum(o.outputs[0].token_ids != r for o, r in zip(plain, refs)) >= 2   # the penalty mattered


def test_the_penalty_history_is_built_and_sent_only_for_steps_that_apply_penalties(llm, monkeypatch):
    """Other steps pass one device-resident zero history (and logit bias) per row bucket:
    nothing built or copied."""
    import jax

    histories, biases = [], []
    for bucket, executable in list(llm.runner._executables.items()):
        def spy(*args, executable=executable):
            histories.append(args[5].history)       # the SamplingMetadata argument
            biases.append(args[5].bias_values)
            return executable(*args)
        monkeypatch.setitem(llm.runner._executables, bucket, spy)
    llm.generate([PROMPT, PROMPT[:2]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    one_per_rows = {}                               # row bucket -> the one zero history of its steps
    assert histories and all(one_per_rows.setdefault(h.shape[0], h) is h for h in histories)
    assert sorted(one_per_rows) == [2, 8]           # the prompts' step (8 rows from 8 tokens), the decodes
    assert all(isinstance(h, jax.Array) and not np.asarray(h).any() and h.shape[1] == 65 for h in histories)
    one_per_rows = {}
    assert all(one_per_rows.setdefault(b.shape[0], b) is b and isinstance(b, jax.Array) for b in biases)
    histories.clear()
    llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True, presence_penalty=0.5), use_tqdm=False)
    assert [type(h) for h in histories] == [np.ndarray] * 3
    assert histories[0][0, :5].tolist() == histories[2][0, :5].tolist() == PROMPT


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.integers(0, 2**16), st.integers(0, 3))
def test_the_blocked_argmax_is_the_first_maximum(rows, vocab, seed, ties):
    """Row maxima anywhere, ties included (the first wins), a vocabulary that no block count
    divides, and all -inf (a grammar masking every token): the same as ``jnp.argmax``."""
    import jax.numpy as jnp

    from jaxengine.sample.sampler import first_argmax

    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, (rows, vocab)).astype(np.float32)          # small integers: many ties
    x[:, rng.integers(0, vocab, ties)] = 3.0
    x[0] = -np.inf if seed % 5 == 0 else x[0]
    assert first_argmax(jnp.asarray(x), num_blocks=7).tolist() == np.argmax(x, -1).tolist()


def test_presence_frequency_and_logit_bias_exact_values():
    import jax.numpy as jnp

    from jaxengine.sample.metadata import SamplingMetadata
    from jaxengine.sample.sampler import apply_penalties

    logits = jnp.asarray([[2.0, -1.0, 0.5, 0.0, 1.0]])
    md = SamplingMetadata(*(jnp.zeros(1) for _ in range(7)), want_logprobs=jnp.zeros(1, bool),
                          presence_penalty=jnp.asarray([0.5]), frequency_penalty=jnp.asarray([0.25]),
                          repetition_penalty=jnp.asarray([2.0]),
                          history=jnp.asarray([[1, 2, 2, 4, 0, 0]]), num_prompt=jnp.asarray([2]),
                          num_history=jnp.asarray([4]), bias_ids=jnp.asarray([[3, 0]]),
                          bias_values=jnp.asarray([[5.0, 0.0]]), logprobs_temperature=jnp.ones(1),
                          token_bitmask=jnp.full((1, 1), -1, jnp.int32), constrained=jnp.zeros(1, bool),
                          stop_bitmask=jnp.zeros((1, 1), jnp.int32), masks_stops=jnp.zeros(1, bool),
                          beam_scores=jnp.zeros(1, bool))
    # prompt [1, 2], outputs [2, 4]; repetition on 1, 2, 4; presence+frequency on 2 (once) and 4 (once)
    expected = [2.0, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 0.0 + 5.0, 1.0 / 2 - 0.25 - 0.5]
    assert apply_penalties(logits, md)[0].tolist() == pytest.approx(expected)


def test_prompt_logprobs_match_transformers_across_prefill_chunks(hf_and_llm):
    import torch

    hf, llm = hf_and_llm
    prompt = [random.Random(9).randrange(256) for _ in range(45)]      # > the 32-token budget: 2 chunks
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    with llm.runner.forbid_compiles():
        out = llm.generate([prompt, prompt[:9]], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    plp = out[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for i in range(1, len(prompt)):
        top3 = np.argsort(-ref[i - 1])[:3].tolist()
        assert set(plp[i]) == set(top3) | {prompt[i]}
        assert plp[i][prompt[i]] == pytest.approx(ref[i - 1, prompt[i]], abs=1e-4)
        assert all(plp[i][t] == pytest.approx(ref[i - 1, t], abs=1e-4) for t in top3)
    for mine, other in zip(out[1].prompt_logprobs[1:], plp[1:9]):         # same prefix, other batch
        assert mine.keys() == other.keys() and all(mine[t] == pytest.approx(other[t], abs=1e-5) for t in mine)


def test_async_scheduling_gives_the_same_tokens_and_logprobs(hf_and_llm, tmp_path_factory):
    """The module's engine schedules ahead (the default); one without it must agree on every
    token, and on every logprob within f32 rounding, of a seeded workload with preemption, n > 1,
    stop tokens and penalties."""
    import torch

    hf, llm = hf_and_llm
    sync = LLM(llm.model_path, skip_tokenizer_init=True, max_num_batched_tokens=32, max_num_seqs=8, block_size=4,
               max_model_len=64, num_kv_blocks=40, swap_space=0.002, progress=False, async_scheduling=False,
               compile_mode="eager")
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), n=rng.choice([1, 1, 2]), temperature=rng.choice([0, 1.0]),
                             seed=i, stop_token_ids=rng.choice([[], [rng.randrange(256)]]), logprobs=2,
                             repetition_penalty=rng.choice([1.0, 1.0, 1.3])) for i in range(60)]
    before = llm.engine.num_run_ahead
    fast = llm.generate(prompts, params, use_tqdm=False)
    slow = sync.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_run_ahead - before > 50 and sync.engine.num_run_ahead == 0
    # The logprobs are not bit-equal: a finished sequence keeps its row one step longer with async
    # scheduling, so the two engines batch the requests differently and a token's step may pad to
    # another bucket, whose projections take another OpenBLAS path (gemv for 1 row, a few-rows loop
    # up to 8, sgemm beyond), and a prompt may be cut into other chunks, attended by the decode
    # kernel or the tiled path: the same f32 sums in another order. To first order a logprob moves
    # by dlp_t = sum_j p_j (dz_t - dz_j), so |dlp_t| <= 2 (1 - p_t) max|dz|. A reordered f32 sum of
    # n terms moves by about n u times their size (u = 2^-24); with n = 128, the model's longest
    # sum (the MLP's width), max|dz| <= n u max|z|, max|z| the row's largest logit magnitude
    # (transformers', times the repetition penalty, which can enlarge it). Two ulps of 1 cover the
    # log-sum's last rounding (a logprob near 0). The differences seen were within 1/7 of this.
    width, u = hf.config.intermediate_size, 2.0 ** -24
    for prompt, p, a, b in zip(prompts, params, fast, slow):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            got, want = (np.array([max(t.values()) for t in c.logprobs]) for c in (ca, cb))
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(ca.token_ids)])).logits[0].numpy()
            scale = np.abs(logits[len(prompt) - 1:len(prompt) - 1 + len(want)]).max(-1) * p.repetition_penalty
            bound = 2 * -np.expm1(np.minimum(got, want)) * width * u * scale + 2.0 ** -22
            assert len(got) == len(want) == len(ca.token_ids) and (np.abs(got - want) <= bound).all(), \
                (got - want, bound)


def test_the_autopilots_budgets_compile_nothing_after_start_up(llm):
    """Every budget the autopilot picks (any token count up to the configured one) pads to a bucket
    compiled at start-up; outputs are those of the same requests without it."""
    from jaxengine.autopilot import Autopilot, OnlineCost
    from jaxengine.config import AutopilotConfig
    from jaxengine.costmodel.profile import FEATURES, CostProfile

    class KnownCost(OnlineCost):
        def observe(self, shape, measured_s):
            """Not corrected by the measured steps: the budgets follow from the profile alone."""

    engine, runner = llm.engine, llm.runner
    # 1 ms a step plus 0.1 ms a padded token: within 3.5 ms, 16 tokens beside decodes (2.6 ms)
    profile = CostProfile({b: [0.001 + 1e-4 * b] + [0.0] * (len(FEATURES) - 1) for b in runner.token_buckets},
                          num_gpu_blocks=40)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.choice([2, 3, 20, 50]))] for _ in range(48)]
    params = [SamplingParams(max_tokens=rng.randint(1, 8), temperature=0, ignore_eos=True) for _ in prompts]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine.planner = Autopilot(AutopilotConfig(ttft_s=0.5, itl_s=0.0035), KnownCost(
        profile, runner.token_buckets, runner.request_buckets), engine.config.scheduler, engine.clock)
    engine.traces = []
    try:
        with runner.forbid_compiles():
            outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.planner = None
    assert runner.num_compiles == 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert {t.autopilot_budget for t in engine.traces} >= {32, 16, 8}    # nothing decoding, decodes, the tail
    assert all(t.num_decode_tokens + t.num_prefill_tokens <= t.autopilot_budget for t in engine.traces)


def test_without_a_profile_the_autopilot_calibrates_the_engine_at_start_up(llm):
    import dataclasses

    from jaxengine.autopilot import attach_autopilot, startup_grid
    from jaxengine.config import AutopilotConfig

    engine = llm.engine
    config, traces = engine.config, engine.traces
    assert startup_grid(engine).contexts == (64 - 4 - 2 * len(llm.runner.token_buckets) - 2,)   # max_model_len 64
    engine.config = dataclasses.replace(config, autopilot=AutopilotConfig(itl_s=0.05))
    try:
        with llm.runner.forbid_compiles():
            autopilot = attach_autopilot(engine, progress=False)
    finally:
        engine.config, engine.planner = config, None
    profile = autopilot.cost.profile
    assert sorted(profile.coefficients) == llm.runner.token_buckets          # every bucket measured
    assert engine.traces is traces and not engine.has_unfinished_requests()      # nothing of it is left
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_usable_blocks
