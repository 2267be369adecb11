"""Background compilation: the engine serves once the smallest bucket is compiled, every step stays
within the buckets compiled so far (nothing compiles on the serving path), and the limits rise
as the larger buckets are done, in an order that keeps the compiled set closed downwards."""
import functools
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams
from jaxengine.buckets import reachable_pairs, step_bucket
from jaxengine.runner.compile import BackgroundCompiler, CompileStage, compile_stages, limits_of, step_pairs

ENGINE = dict(skip_tokenizer_init=True, max_num_batched_tokens=64, max_num_seqs=16, token_buckets=[16, 64],
              request_buckets=[8, 16], block_size=4, max_model_len=64, num_kv_blocks=200, swap_space=0,
              progress=False)


@given(st.lists(st.integers(1, 4096), min_size=1, max_size=7, unique=True),
       st.lists(st.integers(1, 512), min_size=1, max_size=5, unique=True))
def test_every_stage_compiles_what_the_steps_within_its_limits_pad_to(tokens, rows):
    tokens, rows = sorted(tokens), sorted(rows)
    compiled: list = []
    for stage in compile_stages(tokens, rows):
        compiled += stage.pairs
        assert set(reachable_pairs(tokens, rows, *limits_of(stage.largest))) <= set(compiled)
    assert stage.largest == (tokens[-1], rows[-1]) and sorted(compiled) == step_pairs(tokens, rows)
    assert len(set(compiled)) == len(compiled)                            # none compiles twice


@settings(deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=6, unique=True),
       st.lists(st.integers(1, 40), min_size=1, max_size=5, unique=True), st.data())
def test_the_reachable_pairs_are_those_every_step_pads_to(tokens, rows, data):
    tokens, rows = sorted(tokens), sorted(rows)
    max_tokens = data.draw(st.integers(1, tokens[-1]))
    max_rows = data.draw(st.integers(1, rows[-1]))
    every = {step_bucket(n, m, tokens, rows) for n in range(1, max_tokens + 1) for m in range(1, max_rows + 1)}
    assert reachable_pairs(tokens, rows, max_tokens, max_rows) == sorted(every)


def test_a_step_pads_its_tokens_to_its_rows_and_its_rows_to_at_least_8_from_8_tokens():
    tokens, rows = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], [1, 2, 4, 8, 16, 32, 64]
    assert step_bucket(1, 1, tokens, rows) == (1, 1)          # one sequence decoding: no padding
    assert step_bucket(3, 3, tokens, rows) == (4, 4)
    assert step_bucket(5, 1, tokens, rows) == (8, 8)
    assert step_bucket(100, 2, tokens, rows) == (128, 8)
    assert step_bucket(3, 32, tokens, rows) == (32, 32)       # a short prompt sampling n = 32
    assert step_bucket(3, 32, [16], [8, 32]) == (16, 32)      # ... where no token bucket is as wide


def test_the_default_buckets_grow_tokens_and_rows_in_turn():
    stages = compile_stages([1, 2, 4, 8, 16, 32, 64, 128, 256, 512], [1, 2, 4, 8, 16, 32, 64])
    assert [s.largest for s in stages] == [
        (1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8), (16, 16), (32, 16), (32, 32), (64, 32),
        (64, 64), (128, 64), (256, 64), (512, 64)]
    assert [s.pairs for s in stages[:4]] == [[(1, 1)], [(2, 2)], [], [(4, 4)]]
    assert sum(len(s.pairs) for s in stages) == 25             # of the 70 (token, row) combinations
    assert limits_of((16, 32)) == (16, 16)       # every running sequence decodes: rows fit the tokens


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """An engine whose background compiles wait for ``gate``: until it opens, only the smallest
    bucket (16 tokens, 8 rows) exists."""
    from tests.conftest import make_checkpoint

    folder = tmp_path_factory.mktemp("llama-background")
    make_checkpoint(folder, "llama")
    gate = threading.Event()
    with pytest.MonkeyPatch.context() as mp:
        import jaxengine.host
        from jaxengine.runner.model_runner import ModelRunner

        mp.setattr(jaxengine.host, "ModelRunner", functools.partial(ModelRunner, before_compile=lambda _: gate.wait()))
        llm = LLM(folder, compile_mode="background", **ENGINE)
    yield llm, gate
    gate.set()
    llm.runner.close()


@pytest.fixture(scope="module")
def health(gated):
    """GET /health of a server app on the engine (its engine thread not started)."""
    from fastapi.testclient import TestClient

    from jaxengine.serve.api_server import build_app
    from jaxengine.serve.async_engine import AsyncEngine
    from jaxengine.serve.metrics import EngineMetrics

    app = build_app(AsyncEngine(gated[0]), served_model_name="tiny", metrics=EngineMetrics("tiny"))
    client = TestClient(app)
    return lambda: client.get("/health")


def test_a_background_compiling_engine_serves_within_the_compiled_buckets(gated, health):
    llm, gate = gated
    runner = llm.runner
    assert list(runner._executables) == [(16, 8)] and runner.is_compiling
    assert runner.step_limits() == (16, 8) and llm.compile_progress() == (1, 4)
    reply = health()
    assert reply.status_code == 200 and reply.json() == {
        "status": "ok", "all_buckets_compiled": False, "step_buckets_compiled": 1, "step_buckets": 4,
        "kernel_check": {"status": "not run", "detail": "on the CPU only when forced: the plain-jnp path serves",
                         "kernels": []}}
    llm.engine.traces = []
    long_prompt = list(range(1, 41))
    with runner.forbid_compiles():
        out = llm.generate([long_prompt, [5, 6, 7]], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                                      SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=3)],
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and len(out[1].outputs) == 4
    traces = llm.engine.traces
    assert max(t.num_prefill_tokens + t.num_decode_tokens for t in traces) == 16        # the 40 tokens: chunked
    assert max(t.num_rows for t in traces) <= 8 and list(runner._executables) == [(16, 8)]
    assert runner.num_compiles == 0


def test_a_group_larger_than_the_compiled_rows_waits_for_them(gated):
    """Last but one: it opens the gate."""
    llm, gate = gated
    runner = llm.runner
    request = llm.add_request("wide", [9, 8, 7], SamplingParams(n=12, temperature=1.0, seed=2, max_tokens=2))
    with runner.forbid_compiles():
        for _ in range(3):
            llm.engine.step()
        assert not request.is_finished and request.times.first_scheduled is None      # 12 rows > 8: it waits
        gate.set()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert len(request.seqs) == 12 and runner.num_compiles == 0
    assert llm.wait_until_compiled(timeout=120) and not runner.is_compiling
    assert sorted(runner._executables) == [(16, 8), (16, 16), (64, 8), (64, 16)]
    assert runner.step_limits() == (64, 16) and llm.compile_progress() == (4, 4)


def test_once_compiled_the_limits_are_the_configured_ones(gated, health):
    llm, _ = gated
    llm.wait_until_compiled()
    assert health().json()["all_buckets_compiled"] is True
    llm.engine.traces = []
    with llm.runner.forbid_compiles():
        llm.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert max(t.num_prefill_tokens for t in llm.engine.traces) == 40                  # one chunk now


EXITS_WHILE_COMPILING = """
import threading
import jax.numpy as jnp
from flax import nnx
from jaxengine.config import EngineConfig
from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.runner.model_runner import ModelRunner

cfg = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)
config = EngineConfig().replace(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, num_gpu_blocks=32)
compiling = threading.Event()
runner = ModelRunner(LlamaForCausalLM(cfg, jnp.float32, rngs=nnx.Rngs(0)), cfg, config, progress=False,
                     token_buckets=[16, 32, 64], request_buckets=[8], compile_mode="background",
                     before_compile=lambda pair: compiling.set())
compiling.wait()
print("exiting while compiling", flush=True)
"""


def test_the_interpreter_exits_cleanly_while_buckets_compile():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXITS_WHILE_COMPILING)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAXENGINE_XLA_CACHE": "0"})
    assert done.returncode == 0 and "exiting while compiling" in done.stdout, done.stderr[-2000:]
    # (Without the exit hook a compile still running as the interpreter goes down can abort it:
    # "terminate called after throwing ...", "FATAL: exception not rethrown".)
    assert not any(word in done.stderr.lower() for word in ("traceback", "fatal", "terminate")), done.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_while_compiling_the_compiler_threads_yield_the_cores_and_the_gil_to_the_steps():
    """While buckets compile, the compiling thread and XLA's own threads (all but its intra-op
    pool, which runs the steps) are niced to 10 and the GIL changes hands every 0.5 ms; the
    Python threads (the engine loop among them) keep their priority, and the end restores all."""
    import jax.numpy as jnp

    jnp.ones(4).block_until_ready()              # XLA's threads exist
    me = threading.get_native_id()

    def priorities():
        found = {}
        for t in os.listdir("/proc/self/task"):
            try:
                found[int(t)] = os.getpriority(os.PRIO_PROCESS, int(t))
            except ProcessLookupError:           # a thread (another test's) that ended meanwhile
                pass
        return found

    def name(t):
        try:
            return open(f"/proc/self/task/{t}/comm").read().strip()
        except FileNotFoundError:                # ended meanwhile
            return ""

    before, interval = priorities(), sys.getswitchinterval()
    seen = []

    def compile_pair(pair):
        seen.append((pair, priorities(), threading.get_native_id(), sys.getswitchinterval()))

    compiler = BackgroundCompiler([CompileStage([(2, 2)], (2, 2))], compile_pair, lambda limits: None)
    compiler.start()
    assert compiler.wait(timeout=30)
    [(pair, during, compiling, switch)] = seen
    assert pair == (2, 2) and switch == 0.0005 and interval == 0.005
    xla_pool = [t for t in before if name(t).startswith("tf_XLAEigen")]
    python = {t.native_id for t in threading.enumerate()}
    others = [t for t in before if t not in python and t not in xla_pool and t in during]
    assert me in python and xla_pool and others and during[compiling] == 10
    assert all(during[t] == before[t] for t in [*python, *xla_pool] if t in before)
    assert all(during[t] == max(10, before[t]) for t in others)
    after = priorities()
    assert sys.getswitchinterval() == interval
    if os.geteuid() == 0:                        # an unprivileged process cannot lower a nice value again
        assert all(after[t] == before[t] for t in before if t in after)
