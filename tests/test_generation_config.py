"""Generation defaults from the checkpoint's generation_config.json: the fields a request leaves
unset take them, offline and through the server's protocol; ``generation_config="vllm"`` keeps
the engine's own; a bad file or folder is an error naming the option."""
import json
import shutil

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.generation_config import generation_defaults
from jaxengine.serve import protocol as p

OPTIONS = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, max_model_len=64, progress=False,
               num_kv_blocks=64, token_buckets=[32], request_buckets=[4], compile_mode="eager")
FILE = {"temperature": 0.0, "top_k": 7, "repetition_penalty": 1.3, "max_new_tokens": 5, "do_sample": True}
WANT = {"temperature": 0.0, "top_k": 7, "repetition_penalty": 1.3, "max_tokens": 5}


@pytest.fixture(scope="module")
def checkpoint(chat_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("with-generation-config")
    shutil.copytree(chat_checkpoint, folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    return folder


def test_unset_fields_take_the_checkpoints_defaults_offline(checkpoint):
    llm = LLM(checkpoint, **OPTIONS)
    assert llm.generation_defaults == WANT
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.repetition_penalty, default.max_tokens) == (0.0, 7, 1.3, 5)
    implicit = llm.generate(["abc abc"], use_tqdm=False)[0].outputs[0].token_ids
    explicit = llm.generate(["abc abc"], SamplingParams(temperature=0.0, top_k=7, repetition_penalty=1.3, max_tokens=5),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert implicit == explicit and len(implicit) == 5
    assert LLM(checkpoint, generation_config="vllm", warm_up=False, **OPTIONS).get_default_sampling_params() == \
        SamplingParams()


def test_the_servers_requests_take_them_where_unset(checkpoint):
    defaults = generation_defaults("auto", checkpoint)
    chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.5)
    params = chat.sampling_params(None, None, None, defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.5, 7, 1.3, 5)
    completion = p.CompletionRequest(prompt="x", top_k=3).sampling_params(16, None, None, defaults)
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (0.0, 3, 16)
    plain = p.CompletionRequest(prompt="x").sampling_params(16, None, None, {})
    assert (plain.temperature, plain.top_k, plain.repetition_penalty) == (1.0, 0, 1.0)


def test_a_bad_generation_config_is_refused_by_name(checkpoint, tmp_path):
    assert generation_defaults("vllm", checkpoint) == {} and generation_defaults("auto", tmp_path) == {}
    with pytest.raises(ValueError, match="generation_config: .* has no generation_config.json"):
        generation_defaults(str(tmp_path), checkpoint)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config: .*generation_config.json: temperature"):
        generation_defaults(str(tmp_path), checkpoint)


def test_whole_floats_are_read_as_the_integers_they_are(checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50.0, "max_new_tokens": 8.0, "top_p": 1.0}))
    defaults = generation_defaults(str(tmp_path), checkpoint)
    assert defaults == {"top_k": 50, "max_tokens": 8, "top_p": 1.0} and type(defaults["top_k"]) is int
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50.5}))
    with pytest.raises(ValueError, match=r"generation_config: .*generation_config.json: top_k"):
        generation_defaults(str(tmp_path), checkpoint)
