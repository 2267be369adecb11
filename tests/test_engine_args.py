"""EngineArgs: one source for the engine's options, reached the same way from the CLI, LLM(...)
and the configs; dtype="auto" resolved from the platform and the checkpoint."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine import SchedulingPolicy
from jaxengine.engine_args import GiB, EngineArgs, resolve_dtype
from jaxengine.llm import LLM
from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.models.weights import checkpoint_dtype
from jaxengine.serve.__main__ import parse_args as serve_args

CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def module():
    return LlamaForCausalLM(CFG, jnp.float32, rngs=nnx.Rngs(0))


def test_every_field_is_a_flag_with_the_fields_default():
    parsed = serve_args([])
    for f in dataclasses.fields(EngineArgs):
        assert getattr(parsed, f.name) == f.default, f.name
    assert EngineArgs.from_cli_args(parsed) == EngineArgs()


def test_every_field_is_an_llm_keyword_with_the_fields_default(module):
    llm = LLM(module, model_config=CFG, warm_up=False, progress=False)
    assert llm.engine_args == EngineArgs(warm_up=False)
    for f in dataclasses.fields(EngineArgs):                  # each accepted by name, default unchanged
        assert getattr(EngineArgs.from_kwargs(**{f.name: f.default}), f.name) == f.default


def test_flags_reach_the_engine_config():
    args = EngineArgs.from_cli_args(serve_args([
        "--max-num-batched-tokens", "96", "--max-num-seqs", "12", "--block-size", "8", "--num-kv-blocks", "50",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "40",
        "--max-num-partial-prefills", "3", "--scheduling-policy", "priority", "--preemption-mode", "swap",
        "--scheduler-delay-factor", "0.5", "--watermark", "0.1", "--max-model-len", "300",
        "--swap-space", "0.001", "--token-buckets", "32,96", "--request-buckets", "4,12", "--skip-kernel-check"]))
    config = args.create_engine_config(CFG, jnp.float32)
    assert dataclasses.asdict(config.scheduler) == dict(
        max_num_batched_tokens=96, max_num_seqs=12, max_model_len=300, enable_chunked_prefill=False,
        long_prefill_token_threshold=40, max_num_partial_prefills=3, policy="priority", preemption_mode="swap",
        delay_factor=0.5)
    per_block = 2 * CFG.num_layers * 8 * CFG.num_kv_heads * CFG.head_dim * 4          # K and V, f32
    assert dataclasses.asdict(config.cache) == dict(
        block_size=8, num_gpu_blocks=50, num_cpu_blocks=int(0.001 * GiB) // per_block, watermark=0.1,
        enable_prefix_caching=False, group_windows=(None,), num_state_slots=0, num_cpu_state_slots=0,
        state_snapshot_interval=0)
    assert (args.token_buckets, args.request_buckets, args.skip_kernel_check) == ([32, 96], [4, 12], True)


def test_the_engine_config_holds_every_derived_value_resolved_once():
    """What the engine, its runner and its replicas run with is resolved by EngineArgs, once, into
    the EngineConfig: the step buckets, when they compile, async scheduling, the speculative
    config, the dtypes (a bfloat16 model with an fp8 cache), each replica's trace file."""
    args = EngineArgs(max_num_batched_tokens=96, max_num_seqs=12, token_buckets=[32, 96], compile_mode="eager",
                      async_scheduling=False, kv_cache_dtype="fp8", data_parallel_size=2, trace_file="/t/steps.jsonl",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_kv_blocks=40)
    config = args.create_engine_config(CFG, dtype=jnp.bfloat16)
    assert dataclasses.asdict(config.runner) == dict(
        token_buckets=(32, 96), request_buckets=(1, 2, 4, 8, 12), compile_mode="eager", async_scheduling=False,
        dtype="bfloat16", kv_dtype="float8_e4m3fn", trace_files=("/t/steps.replica0.jsonl", "/t/steps.replica1.jsonl"))
    assert config.step_buckets() == ([32, 96], [1, 2, 4, 8, 12])
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert config.runner.trace_file(1) == "/t/steps.replica1.jsonl" and config.runner.trace_file(2) is None
    defaults = EngineArgs(max_num_batched_tokens=64, max_num_seqs=8).create_engine_config(CFG, jnp.float32)
    assert dataclasses.asdict(defaults.runner) == dict(
        token_buckets=(1, 2, 4, 8, 16, 32, 64), request_buckets=(1, 2, 4, 8), compile_mode="background",
        async_scheduling=True, dtype=None, kv_dtype="float32", trace_files=(None,))
    # A config built by hand resolves the buckets from the scheduler's limits; shrinking the limits
    # drops buckets resolved for the old ones.
    assert defaults.replace(max_num_seqs=4).step_buckets() == ([1, 2, 4, 8, 16, 32, 64], [1, 2, 4])
    assert args.resolve_model_dtype(built="bfloat16") == jnp.bfloat16     # dtype auto: a built model's own
    assert EngineArgs(dtype="bfloat16").resolve_model_dtype(built="float32") == jnp.bfloat16
    assert EngineArgs().resolve_model_dtype(lambda: "bfloat16") == (
        jnp.float32 if jax.devices()[0].platform == "cpu" else jnp.bfloat16)


def test_to_cli_args_writes_what_differs_from_the_defaults_and_parses_back():
    assert EngineArgs().to_cli_args() == []
    args = EngineArgs(model="/m", max_num_batched_tokens=96, enable_prefix_caching=False, async_scheduling=False,
                      token_buckets=[32, 96], scheduler_delay_factor=0.5, preemption_mode="swap")
    assert args.to_cli_args() == ["--model", "/m", "--max-num-batched-tokens", "96", "--no-enable-prefix-caching",
                                  "--preemption-mode", "swap", "--scheduler-delay-factor", "0.5",
                                  "--no-async-scheduling", "--token-buckets", "32,96"]
    assert EngineArgs.from_cli_args(serve_args(args.to_cli_args())) == args


def test_flags_reach_the_llm(module):
    args = EngineArgs.from_cli_args(serve_args(["--max-num-batched-tokens", "64", "--max-num-seqs", "8",
                                                "--token-buckets", "16,64", "--num-kv-blocks", "30",
                                                "--no-warm-up", "--no-async-scheduling"]))
    llm = LLM(module, model_config=CFG, progress=False, **{k: v for k, v in dataclasses.asdict(args).items()
                                                          if k != "model"})
    assert llm.runner.token_buckets == [16, 64]
    assert (llm.config.scheduler.max_num_batched_tokens, llm.config.cache.num_gpu_blocks) == (64, 30)
    assert llm.engine.async_scheduling is False


def test_kv_pool_sized_from_the_byte_budget_on_the_cpu():
    config = EngineArgs(block_size=16, kv_cache_memory_bytes=1 << 20).create_engine_config(CFG, jnp.bfloat16)
    per_block = 2 * CFG.num_layers * 16 * CFG.num_kv_heads * CFG.head_dim * 2
    assert config.cache.num_gpu_blocks == (1 << 20) // per_block
    assert config.scheduler.max_model_len == 2048                  # the model's 4096, capped


def test_unknown_llm_keyword_is_named(module):
    with pytest.raises(TypeError, match="^max_num_seq: not an engine option; did you mean 'max_num_seqs'"):
        LLM(module, model_config=CFG, max_num_seq=4, warm_up=False, progress=False)


@pytest.mark.parametrize("field, value", [("dtype", "float16"), ("attention_backend", "triton"),
                                          ("scheduling_policy", "lifo"), ("preemption_mode", "drop")])
def test_a_value_outside_the_choices_is_named(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be one of"):
        EngineArgs(**{field: value})


class OldestFirst(SchedulingPolicy):
    """A user's policy, importable as tests.test_engine_args:OldestFirst."""

    def key(self, request, kv):
        return (request.arrival_time,)


@pytest.mark.parametrize("options, message", [
    (dict(max_num_batched_tokens=64, token_buckets=[16, 32]), r"token_buckets: must be positive and end at 64 "),
    (dict(max_num_seqs=8, request_buckets=[0, 8]), r"request_buckets: must be positive and end at 8 "),
])
def test_bad_step_buckets_are_refused_with_the_options(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


def test_the_step_buckets_are_worked_out_once_from_the_options():
    assert EngineArgs(max_num_batched_tokens=64, max_num_seqs=16).step_buckets() == ([1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16])
    assert EngineArgs(max_num_batched_tokens=64, token_buckets=[64, 8, 8]).step_buckets()[0] == [8, 64]


@pytest.mark.parametrize("spec, message", [
    ("lifo", "must be one of \\['fcfs', 'priority', 'shortest-prompt-first', 'longest-cached-prefix-first'\\] "
             "or 'module:Class'"),
    ("no_such_policy_module:P", "cannot import module 'no_such_policy_module'"),
    ("jaxengine:Nope", "module 'jaxengine' has no attribute 'Nope'"),
    ("jaxengine:Engine", "<class 'jaxengine.engine.Engine'> is not a SchedulingPolicy subclass"),
])
def test_a_bad_scheduling_policy_is_named(spec, message):
    with pytest.raises(ValueError, match=f"^scheduling_policy: {message}"):
        EngineArgs(scheduling_policy=spec)


def test_a_user_policy_flag_loads_the_class_and_reaches_the_engine_config(tmp_path, monkeypatch):
    (tmp_path / "tests_mod.py").write_text("from jaxengine import SchedulingPolicy\n\n\n"
                                           "class Cls(SchedulingPolicy):\n"
                                           "    def key(self, request, kv):\n"
                                           "        return (-request.num_prompt_tokens,)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "tests_mod", raising=False)
    args = EngineArgs.from_cli_args(serve_args(["--scheduling-policy", "tests_mod:Cls"]))
    assert args.scheduling_policy == "tests_mod:Cls"
    assert args.to_cli_args() == ["--scheduling-policy", "tests_mod:Cls"]
    config = args.create_engine_config(CFG, jnp.float32)
    assert config.scheduler.policy == "tests_mod:Cls"


def test_a_policy_class_is_written_as_module_colon_class_and_an_instance_is_refused():
    args = EngineArgs(scheduling_policy=OldestFirst)
    assert args.to_cli_args() == ["--scheduling-policy", "tests.test_engine_args:OldestFirst"]
    assert EngineArgs(scheduling_policy=OldestFirst()).scheduling_policy.name == "OldestFirst"
    with pytest.raises(ValueError, match="^scheduling_policy: a policy instance cannot be written as a flag"):
        EngineArgs(scheduling_policy=OldestFirst()).to_cli_args()


def test_the_scheduling_policy_help_lists_the_built_ins(capsys):
    with pytest.raises(SystemExit):
        serve_args(["--help"])
    text = "".join(capsys.readouterr().out.split())
    assert "fcfs,priority,shortest-prompt-first,longest-cached-prefix-first" in text
    assert "module:Class" in text and "SchedulingPolicysubclass" in text


def test_a_bad_list_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        serve_args(["--token-buckets", "16,x"])
    assert "expected comma-separated int values, got '16,x'" in capsys.readouterr().err


def test_the_speculative_config_flag_is_a_json_object_that_round_trips(capsys):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    args = EngineArgs.from_cli_args(serve_args(["--speculative-config", json.dumps(spec)]))
    assert args.speculative_config == spec
    assert EngineArgs.from_cli_args(serve_args(args.to_cli_args())) == args
    config = args.create_engine_config(CFG, jnp.float32)
    assert (config.speculative.method, config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_min,
            config.speculative.prompt_lookup_max) == ("ngram", 3, 1, 4)
    assert EngineArgs().create_engine_config(CFG, jnp.float32).speculative is None
    with pytest.raises(SystemExit):
        serve_args(["--speculative-config", "[1, 2]"])
    assert "expected a JSON object, got '[1, 2]'" in capsys.readouterr().err


def test_help_comes_from_the_fields(capsys):
    with pytest.raises(SystemExit):
        serve_args(["--help"])
    out = capsys.readouterr().out
    text, squeezed = " ".join(out.split()), "".join(out.split())    # argparse wraps lines, also at hyphens
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in text
        assert "".join(f.metadata["help"].split()) in squeezed
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "(default: None)" not in text


# ---------------------------------------------------------------- dtype="auto"
def safetensors_checkpoint(folder, dtype, config=None):
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or {}))
    save_file({"a": torch.zeros(4, dtype=dtype), "b": torch.zeros(2, dtype=dtype)}, folder / "model.safetensors")
    return folder


def gguf_checkpoint(path, quantised: bool):
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    data = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    if quantised:
        kind = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor("w", gguf.quants.quantize(data, kind), raw_dtype=kind)
    else:
        writer.add_tensor("w", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_checkpoint_dtype_from_tensors_config_and_gguf(tmp_path):
    import torch

    assert checkpoint_dtype(safetensors_checkpoint(tmp_path / "bf16", torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(safetensors_checkpoint(tmp_path / "f32", torch.float32)) == "float32"
    assert checkpoint_dtype(safetensors_checkpoint(tmp_path / "f16", torch.float16)) == "float16"
    named = safetensors_checkpoint(tmp_path / "named", torch.float32, {"torch_dtype": "bfloat16"})
    assert checkpoint_dtype(named) == "bfloat16"                        # config.json says so first
    assert checkpoint_dtype(gguf_checkpoint(tmp_path / "q8.gguf", quantised=True)) == "quantized"
    assert checkpoint_dtype(gguf_checkpoint(tmp_path / "f32.gguf", quantised=False)) == "float32"


@pytest.mark.parametrize("stored, platform, want", [
    ("bfloat16", "cpu", jnp.float32), ("float32", "cpu", jnp.float32), ("quantized", "cpu", jnp.float32),
    ("bfloat16", "gpu", jnp.bfloat16), ("float32", "gpu", jnp.float32), ("float16", "gpu", jnp.bfloat16),
    ("quantized", "gpu", jnp.bfloat16), (None, "gpu", jnp.bfloat16), ("bfloat16", "tpu", jnp.bfloat16),
])
def test_auto_dtype_by_platform_and_checkpoint(stored, platform, want):
    assert resolve_dtype("auto", stored, platform) == want


def test_auto_dtype_of_saved_checkpoints(tmp_path):
    import torch

    bf16 = checkpoint_dtype(safetensors_checkpoint(tmp_path / "bf16", torch.bfloat16))
    f32 = checkpoint_dtype(safetensors_checkpoint(tmp_path / "f32", torch.float32))
    assert [resolve_dtype("auto", d, p) for d in (bf16, f32) for p in ("cpu", "gpu")] == \
        [jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32]


def test_an_explicit_dtype_is_kept_on_every_platform():
    assert resolve_dtype("bfloat16", "float32", "cpu") == jnp.bfloat16
    assert resolve_dtype("float32", "bfloat16", "gpu") == jnp.float32


def test_llm_on_the_cpu_runs_a_bf16_checkpoint_in_f32(checkpoint_bf16):
    llm = LLM(checkpoint_bf16, warm_up=False, progress=False, skip_tokenizer_init=True, num_kv_blocks=8)
    assert llm.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(nnx.state(llm.model))} == {jnp.dtype(jnp.float32)}
    assert llm.runner.kv_caches[0].dtype == jnp.float32


@pytest.fixture
def checkpoint_bf16(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    return tmp_path


def test_engine_args_is_exported_from_the_package():
    import jaxengine
    from jaxengine.engine_args import EngineArgs

    assert jaxengine.EngineArgs is EngineArgs
    assert "EngineArgs" in jaxengine.__all__


def test_sliding_layers_get_groups_of_their_own_and_a_block_holds_one_groups_layers():
    """gpt-oss's shape (sliding and full layers alternating, 24 of them): two groups of 12, so a
    block costs 12 layers' K and V and the pool holds twice the blocks; a model whose every layer
    slides keeps its window too, unless a draft model reads its one table."""
    alternating = CFG.replace(num_layers=24, sliding_window=128, full_attention_layers=tuple(range(1, 24, 2)))
    args = EngineArgs(block_size=16, kv_cache_memory_bytes=GiB)
    per_block = args.kv_bytes_per_block(alternating, jnp.float32)
    assert per_block == 2 * 12 * 16 * CFG.num_kv_heads * CFG.head_dim * 4
    config = args.create_engine_config(alternating, jnp.float32)
    assert config.cache.group_windows == (None, 128) and config.cache.num_gpu_blocks == GiB // per_block
    sliding = CFG.replace(sliding_window=64)
    assert args.create_engine_config(sliding, jnp.float32).cache.group_windows == (64,)
    drafted = EngineArgs(speculative_config={"method": "draft_model", "model": "/d", "num_speculative_tokens": 2})
    assert drafted.group_windows(sliding) == (None,) and drafted.group_windows(alternating) == (None, 128)


def test_a_hybrid_models_state_slots_come_out_of_the_cache_budget(caplog):
    """Qwen3.5's pattern (6 recurrent layers, 2 attending): a state slot holds 6 layers' convolution
    window and matrix state in float32; 2 slots a sequence, the null slot and as many again for
    snapshots, taken from the budget before the KV blocks; where they would take more than half of
    it, fewer sequences run at once; the host's slots come out of swap_space."""
    from jaxengine.models.config import GatedDeltaNetShape

    hybrid = CFG.replace(architecture="Qwen3_5ForCausalLM", num_layers=8, linear_attention_layers=(0, 1, 2, 4, 5, 6),
                         linear_attention=GatedDeltaNetShape(32, 2, 4, 8, 8), attention_output_gate=True)
    per_slot = 6 * (3 * (2 * 16 + 32) + 4 * 8 * 8) * 4
    assert hybrid.state_bytes_per_slot == per_slot == 10752
    per_block = 2 * 2 * 16 * CFG.num_kv_heads * CFG.head_dim * 4           # the 2 attention layers' K and V
    args = EngineArgs(block_size=16, max_num_seqs=8, kv_cache_memory_bytes=1 << 20, swap_space=64 * per_slot / GiB)
    cache, scheduler = (lambda c: (c.cache, c.scheduler))(args.create_engine_config(hybrid, jnp.float32))
    assert (cache.num_state_slots, cache.num_cpu_state_slots, scheduler.max_num_seqs) == (33, 8, 8)
    assert cache.num_gpu_blocks == ((1 << 20) - 33 * per_slot) // per_block and cache.state_snapshot_interval == 16
    # Half of 256 KiB holds 12 slots: 5 sequences at once (their 11 slots) and 1 snapshot slot
    small = dataclasses.replace(args, kv_cache_memory_bytes=1 << 18)
    config = small.create_engine_config(hybrid, jnp.float32)
    assert (config.cache.num_state_slots, config.scheduler.max_num_seqs) == (12, 5)
    assert "max_num_seqs: 5 sequences at once, not 8" in caplog.text
    with pytest.raises(ValueError, match="cannot hold the few a step needs"):
        dataclasses.replace(args, kv_cache_memory_bytes=4 * per_slot).create_engine_config(hybrid, jnp.float32)
    with pytest.raises(ValueError, match="speculative decoding is not supported yet for Qwen3_5ForCausalLM"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config(hybrid)
    with pytest.raises(ValueError, match="LoRA adapters are not supported yet"):
        EngineArgs(enable_lora=True).create_engine_config(hybrid)
    with pytest.raises(ValueError, match="several processes are not supported yet"):
        EngineArgs(num_processes=2).create_engine_config(hybrid)
