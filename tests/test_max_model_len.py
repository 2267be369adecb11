"""max_model_len past the model's context length is refused, naming both numbers, unless
allow_long_max_model_len; the default still comes from max_position_embeddings."""
import logging
import re

import jax.numpy as jnp
import pytest
from flax import nnx
from transformers import AutoConfig

from jaxengine.engine_args import EngineArgs
from jaxengine.llm import LLM
from jaxengine.models.config import ModelConfig, YarnScaling
from jaxengine.models.gguf import read_gguf
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.serve.__main__ import parse_args as serve_args

from tests.conftest import TINY, make_checkpoint
from tests.models.test_weights import write_gguf

CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
OVERRIDE = ". Set allow_long_max_model_len (--allow-long-max-model-len) to allow it"
UNTRAINED = "positions past it were never trained and may give wrong outputs"


def refusal(asked: int, limit: int, source: str) -> str:
    return f"max_model_len: {asked} is more than the model's context length, {limit} ({source}); {UNTRAINED}"


def refused(asked: int, limit: int, source: str):
    return pytest.raises(ValueError, match="^" + re.escape(refusal(asked, limit, source) + OVERRIDE) + "$")


def test_a_max_model_len_past_max_position_embeddings_is_refused_naming_both():
    assert EngineArgs(max_model_len=512).create_engine_config(CFG, jnp.float32).scheduler.max_model_len == 512
    with refused(513, 512, "max_position_embeddings 512"):
        EngineArgs(max_model_len=513).create_engine_config(CFG, jnp.float32)


def test_the_override_allows_it_with_a_warning(caplog):
    args = EngineArgs(max_model_len=4096, allow_long_max_model_len=True)
    with caplog.at_level(logging.WARNING, logger="jaxengine"):
        assert args.create_engine_config(CFG, jnp.float32).scheduler.max_model_len == 4096
    assert [r.getMessage() for r in caplog.records] == [
        refusal(4096, 512, "max_position_embeddings 512") + " (allowed by allow_long_max_model_len)"]


@pytest.mark.parametrize("max_position_embeddings, default", [(512, 512), (4096, 2048)])
def test_the_default_is_still_max_position_embeddings_at_most_2048(max_position_embeddings, default):
    cfg = CFG.replace(max_position_embeddings=max_position_embeddings)
    assert EngineArgs().create_engine_config(cfg, jnp.float32).scheduler.max_model_len == default
    assert EngineArgs().resolve_max_model_len(cfg) == default


def test_yarn_extends_the_limit_to_original_times_factor():
    yarn = CFG.replace(max_position_embeddings=128,
                       rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64))
    assert yarn.context_length() == (256, "original_max_position_embeddings 64 x YaRN factor 4")
    assert EngineArgs(max_model_len=256).resolve_max_model_len(yarn) == 256
    with refused(257, 256, "original_max_position_embeddings 64 x YaRN factor 4"):
        EngineArgs(max_model_len=257).resolve_max_model_len(yarn)
    assert EngineArgs().resolve_max_model_len(yarn) == 128           # the default: as before
    # where max_position_embeddings is already the longer (gpt-oss, DeepSeek-V3 write it so), it is the limit
    short = yarn.replace(max_position_embeddings=1024)
    assert short.context_length() == (1024, "max_position_embeddings 1024")


def test_yarn_and_llama3_from_a_transformers_config():
    yarn = ModelConfig.from_hf(AutoConfig.for_model("qwen2", **{**TINY, "max_position_embeddings": 128},
                                                    rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 64,
                                                                     "rope_theta": 10000.0}))
    assert yarn.context_length() == (256, "original_max_position_embeddings 64 x YaRN factor 4")
    # Llama 3's max_position_embeddings already counts its scaling (vLLM's reading too)
    llama3 = ModelConfig.from_hf(AutoConfig.for_model("llama", **TINY, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}))
    assert llama3.context_length() == (512, "max_position_embeddings 512")


def test_a_gguf_context_length_is_the_limit(tmp_path):
    hf_model = make_checkpoint(tmp_path / "hf", "llama", max_position_embeddings=96)
    write_gguf(tmp_path / "ctx96.gguf", hf_model)          # context_length 96 in its metadata
    cfg, _ = read_gguf(tmp_path / "ctx96.gguf")
    assert cfg.context_length() == (96, "max_position_embeddings 96")
    assert EngineArgs().resolve_max_model_len(cfg) == 96
    with refused(97, 96, "max_position_embeddings 96"):
        EngineArgs(max_model_len=97).resolve_max_model_len(cfg)


def test_the_option_is_a_flag_in_the_servers_help(capsys):
    with pytest.raises(SystemExit):
        serve_args(["--help"])
    assert "--allow-long-max-model-len, --no-allow-long-max-model-len" in capsys.readouterr().out
    args = EngineArgs.from_cli_args(serve_args(["--max-model-len", "600", "--allow-long-max-model-len"]))
    assert (args.max_model_len, args.allow_long_max_model_len) == (600, True)
    assert EngineArgs.from_cli_args(serve_args([])).allow_long_max_model_len is False


def test_llm_refuses_it_and_runs_with_the_override():
    module = LlamaForCausalLM(CFG, jnp.float32, rngs=nnx.Rngs(0))
    options = dict(model_config=CFG, warm_up=False, progress=False, num_kv_blocks=16, max_num_batched_tokens=16,
                   max_num_seqs=4)
    with refused(600, 512, "max_position_embeddings 512"):
        LLM(module, max_model_len=600, **options)
    llm = LLM(module, max_model_len=600, allow_long_max_model_len=True, **options)
    assert llm.config.scheduler.max_model_len == 600
