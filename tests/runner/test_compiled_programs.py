"""The programs the engine compiles, read as XLA compiled them under the flags the engine runs with
(in a process of its own: the suite's own faster-compiling flags produce other programs, where a
whole-pool copy in every layer once went unseen and made decoding hundreds of times slower).

For every configuration the engine serves, every step, block move and draft program: no temporary
buffer and no copy as large as one layer's part of the KV pool (a pool of 2048 blocks, far larger
than any weight of these tiny models), and the steps update the donated caches in place. And for
the default model's own shapes, a decode step reads within a small multiple of what it must read:
its weights and the KV of its tokens. Each check fails on the code that copied the pool (every
configuration here did, in its one-row steps)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEEPSEEK, DEEPSEEK_VARIANTS, MOE_VARIANTS, NEMOTRON_H, QWEN3_5, TINY, make_checkpoint

PROBE = Path(__file__).with_name("compiled_programs.py")
TEST_ONLY_FLAGS = ("--xla_cpu_use_fusion_emitters", "--xla_backend_optimization_level")


def engine_env() -> dict:
    """This process's environment less the suite's compiler flags (its simulated devices stay)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in TEST_ONLY_FLAGS]
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAXENGINE_XLA_CACHE="0")


def run_probe(tmp_path: Path, configs: list[dict]) -> dict:
    spec = tmp_path / "configs.json"
    spec.write_text(json.dumps([{**c, "model": c["model"] and str(c["model"])} for c in configs]))
    done = subprocess.run([sys.executable, str(PROBE), str(spec)], env=engine_env(), capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def pool_copies(reports: dict) -> list[str]:
    """Each program that holds a temporary or makes a copy of a layer's part of the pool, or whose
    step does not update its caches in place."""
    problems = []
    for config, r in reports.items():
        for name, p in r["programs"].items():
            if p["temp"] >= r["layer_slice"] or p["copy"] >= r["layer_slice"]:
                problems.append(f"{config}, {name}: temp {p['temp']} B, largest copy {p['copy']} B, "
                                f"a layer's part of the pool {r['layer_slice']} B")
            if r["state_slice"] is not None and name.startswith("step") and p["copy"] >= r["state_slice"]:
                problems.append(f"{config}, {name}: largest copy {p['copy']} B, a layer's part of the recurrent "
                                f"state pool {r['state_slice']} B")
            caches = r["draft_caches"] if name.startswith("draft step") else r["caches"]
            if name.startswith(("step", "draft step")) and p["aliased"] < caches:
                problems.append(f"{config}, {name}: {p['aliased']} B updated in place of {caches} B of caches")
    return problems


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("programs-llama")
    make_checkpoint(folder, "llama")
    return folder


def family_configs(family: str, tmp_path_factory, llama) -> list[dict]:
    """The configurations of one family of checks (each family a probe process of its own, so the
    families spread over the test workers)."""
    if family == "dense":
        return [dict(name="gqa", model=llama),
                dict(name="int4 weights, fp8 KV cache, LoRA", model=llama,
                     options=dict(quantization="int4", kv_cache_dtype="fp8", enable_lora=True, max_lora_rank=8)),
                dict(name="one KV head per device", model=llama, options=dict(tensor_parallel_size=TINY[
                    "num_key_value_heads"]))]
    if family == "latent attention, experts":
        deepseek = tmp_path_factory.mktemp("programs-deepseek")
        make_checkpoint(deepseek, "deepseek_v3", **{**DEEPSEEK, **DEEPSEEK_VARIANTS["no-q-lora"]})
        moe = tmp_path_factory.mktemp("programs-moe")
        make_checkpoint(moe, MOE_VARIANTS["gpt-oss"][0], **MOE_VARIANTS["gpt-oss"][1])
        return [dict(name="latent attention", model=deepseek),
                dict(name="latent attention, 2 devices", model=deepseek, options=dict(tensor_parallel_size=2)),
                dict(name="mixture of experts, sliding layer groups", model=moe)]
    hybrid = tmp_path_factory.mktemp("programs-hybrid")     # states of 1 Ki floats: a layer's part of the pool is
    make_checkpoint(hybrid, QWEN3_5[0], **{**QWEN3_5[1], "linear_num_value_heads": 8,   # larger than the step's
                                           "linear_value_head_dim": 16})                 # activations
    nemotron = tmp_path_factory.mktemp("programs-nemotron")      # its pattern has no shorter period: one trip
    make_checkpoint(nemotron, NEMOTRON_H[0], **{**NEMOTRON_H[1], "mamba_num_heads": 8, "mamba_head_dim": 16})
    # (slots for 16 sequences: the pool's layer part well above a step's rows of state)
    options = dict(max_num_seqs=16, request_buckets=[1, 16])
    return [dict(name="hybrid, recurrent states", model=hybrid, options=options),
            dict(name="hybrid of one period, 2 devices", model=nemotron, options=dict(options, tensor_parallel_size=2))]


@pytest.mark.parametrize("family", ["dense", "latent attention, experts", "hybrid"])
def test_the_model_families_compile_without_a_pool_copy(family, tmp_path, tmp_path_factory, llama):
    """GQA; quantized weights, an FP8 cache and LoRA (one engine holding the three: each changes
    its own part of the step, and a copy any of them made would show); one KV head per device
    under tensor parallelism; latent attention (alone and under tensor parallelism); a mixture of
    experts whose sliding layers keep their KV in groups of their own (gpt-oss: each layer reads
    its group's place in the cache through its group's tables); a hybrid model (Qwen3.5: its
    recurrent state pools updated in place too, no copy of a layer's part of them either; under
    tensor parallelism its decode step once copied them, two writes of a pool apart) and one whose
    layer pattern has no shorter period (Nemotron-H, under tensor parallelism: its layers run as
    one trip, whose decode step once copied the KV pool)."""
    configs = family_configs(family, tmp_path_factory, llama)
    reports = run_probe(tmp_path, configs)
    assert sorted(reports) == sorted(c["name"] for c in configs)
    assert all(any(n.startswith("block") for n in r["programs"]) for r in reports.values())   # moves were read too
    problems = pool_copies(reports)
    assert not problems, "\n".join(problems)


def test_the_speculative_proposers_compile_without_a_pool_copy(tmp_path, tmp_path_factory, llama):
    """A draft model, an EAGLE-3 head and DeepSeek-V3's multi-token prediction layer: their steps,
    proposals and block moves too."""
    from tests.conftest import make_deepseek_checkpoint
    from tests.e2e.test_eagle3 import make_head
    from tests.e2e.test_mtp import add_mtp_layer

    head = tmp_path_factory.mktemp("programs-eagle3")
    make_head(head, llama, norm_before_residual=False, own_embedding=False, seed=0)
    deepseek = tmp_path_factory.mktemp("programs-mtp")
    add_mtp_layer(deepseek, make_deepseek_checkpoint(deepseek, "no-q-lora"))
    spec = dict(num_speculative_tokens=2)
    configs = [dict(name="draft model", model=llama,
                    options=dict(speculative_config={**spec, "method": "draft_model", "model": str(llama)})),
               dict(name="EAGLE-3", model=llama,
                    options=dict(speculative_config={**spec, "method": "eagle3", "model": str(head)})),
               dict(name="MTP", model=deepseek, options=dict(speculative_config={**spec, "method": "mtp"}))]
    reports = run_probe(tmp_path, configs)
    assert all(any(n.startswith("draft proposal") for n in r["programs"]) for r in reports.values())
    problems = pool_copies(reports)
    assert not problems, "\n".join(problems)


def test_the_default_models_decode_step_reads_what_it_must(tmp_path):
    """The default model as ``LLM()`` builds it (its GGUF's int4 weights, the default 1 GiB pool),
    its one-row decode step: XLA's cost analysis counts no more bytes than a small multiple of its
    weights and the KV of a whole context, plus the pool once (the decode kernel is handed the pool
    whole, and XLA counts a custom call's operands as read; it reads its rows' pages). A copy of
    the pool in every layer counts over ten times the pool (11.8 GB against 1.09 GB, measured on
    the code that copied). And it holds no temporary as large as a layer's part of the pool."""
    from jaxengine import default_model

    try:
        default_model.default_model_path(progress=False)
    except RuntimeError as e:
        pytest.skip(str(e))
    reports = run_probe(tmp_path, [dict(name="default model", model=None, options=dict(
        num_kv_blocks=None, max_model_len=None, token_buckets=[1], request_buckets=[1], max_num_batched_tokens=1,
        max_num_seqs=1))])
    r = reports["default model"]
    decode = r["programs"]["step (1, 1)"]
    must_read = r["weights"] + r["kv_per_token"] * r["max_model_len"]
    assert r["caches"] > 0.99 * (1 << 30)                                        # the default pool
    assert decode["bytes_accessed"] <= 3 * must_read + r["caches"], (decode, must_read, r["caches"])
    assert decode["temp"] < r["layer_slice"] and decode["copy"] < r["layer_slice"]
