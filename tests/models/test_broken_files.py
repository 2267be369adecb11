"""A missing, truncated or corrupt checkpoint file is an error naming the file and what is wrong
with it (the library's own error chained), the same through LLM(...) and the server's start."""
import json
import re
import shutil

import pytest
from safetensors import SafetensorError

from jaxengine.generation_config import generation_defaults
from jaxengine.llm import LLM
from jaxengine.paths import CheckpointFileError, converted_cache_path
from jaxengine.models.weights import checkpoint_dtype, load_model, read_safetensors_folder
from jaxengine.tokenizer import load_tokenizer

from tests.conftest import make_checkpoint
from tests.models.test_weights import write_gguf

FOLDER_HINT = "; --model must be a Hugging Face checkpoint folder or a .gguf file"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a single-file checkpoint folder, a sharded one with its index, a GGUF file)."""
    single = tmp_path_factory.mktemp("single")
    hf_model = make_checkpoint(single, "llama")
    sharded = tmp_path_factory.mktemp("sharded")
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    gguf_file = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(gguf_file, hf_model)
    return single, sharded, gguf_file


@pytest.fixture()
def single(tiny, tmp_path):
    return shutil.copytree(tiny[0], tmp_path / "single")


@pytest.fixture()
def sharded(tiny, tmp_path):
    return shutil.copytree(tiny[1], tmp_path / "sharded")


@pytest.fixture()
def gguf_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    return shutil.copy(tiny[2], tmp_path / "tiny.gguf")


def truncate(path, by: int) -> tuple[int, int]:
    """Cut ``by`` bytes off the end of ``path`` -> (size before, size after)."""
    data = path.read_bytes()
    path.write_bytes(data[:-by])
    return len(data), len(data) - by


def raises_exactly(error_type, message: str):
    return pytest.raises(error_type, match=f"^{re.escape(message)}$")


# ---------------------------------------------------------------- safetensors
def test_a_truncated_safetensors_file_is_named_with_both_sizes(single):
    file = single / "model.safetensors"
    before, after = truncate(file, 100)
    message = f"{file}: truncated or corrupt safetensors file (header says {before} bytes, file has {after})"
    with raises_exactly(CheckpointFileError, message) as caught:
        load_model(single)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value.__cause__, SafetensorError)
    assert (caught.value.path, caught.value.problem) == (file, message.split(": ", 1)[1])
    with raises_exactly(CheckpointFileError, message):          # reading every tensor in full too
        read_safetensors_folder(single)


@pytest.mark.parametrize("content, problem", [
    (b"abc", "truncated or corrupt safetensors file (file has 3 bytes, fewer than the 8 of the header's length)"),
    (b"not a safetensors file at all",
     f"truncated or corrupt safetensors file (header length says at least "
     f"{int.from_bytes(b'not a sa', 'little') + 8} bytes, file has 29)"),
    ((5).to_bytes(8, "little") + b"{oops",
     "corrupt safetensors file (its 5-byte header is not a safetensors header: Expecting property name enclosed "
     "in double quotes: line 1 column 2 (char 1))"),
])
def test_a_garbage_safetensors_file_is_named_with_what_is_wrong(single, content, problem):
    file = single / "model.safetensors"
    file.write_bytes(content)
    with raises_exactly(CheckpointFileError, f"{file}: {problem}") as caught:
        load_model(single)
    assert isinstance(caught.value.__cause__, SafetensorError)


def test_a_truncated_shard_of_a_sharded_checkpoint_is_the_one_named(sharded):
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    before, after = truncate(shards[1], 1)
    with raises_exactly(CheckpointFileError, f"{shards[1]}: truncated or corrupt safetensors file "
                                             f"(header says {before} bytes, file has {after})"):
        load_model(sharded)


def test_a_shard_the_index_names_that_is_missing_is_named(sharded):
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[-1].unlink()
    with raises_exactly(FileNotFoundError, f"{shards[-1]}: no such file; model.safetensors.index.json names it "
                                           f"(1 of its {len(shards)} shards missing: ['{shards[-1].name}'])"):
        load_model(sharded)


def test_a_missing_shard_without_the_index_is_named(sharded):
    shards = sorted(sharded.glob("model-*.safetensors"))
    (sharded / "model.safetensors.index.json").unlink()
    load_model(sharded)                          # every shard there: the index is not needed
    shards[0].unlink()
    with raises_exactly(FileNotFoundError, f"{shards[0]}: no such file; {shards[1].name} is one of {len(shards)} "
                                           f"shards and there is no model.safetensors.index.json (1 missing: "
                                           f"['{shards[0].name}'])"):
        load_model(sharded)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ('{"weight_map": []}', "no weight_map (tensor name -> shard file) in it"),
    ("[1, 2]", "expected a JSON object, got a list"),
])
def test_a_garbage_index_is_named(sharded, content, problem):
    index = sharded / "model.safetensors.index.json"
    index.write_text(content)
    with raises_exactly(CheckpointFileError, f"{index}: {problem}"):
        load_model(sharded)


# ---------------------------------------------------------------- config.json, the model path
@pytest.mark.parametrize("content, problem", [
    (b"", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\x00\x01garbage", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\xff\xfe{}", "not valid JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    (b'"llama"', "expected a JSON object, got a str"),
])
def test_a_garbage_config_json_is_named(single, content, problem):
    config = single / "config.json"
    config.write_bytes(content)
    with raises_exactly(CheckpointFileError, f"{config}: {problem}") as caught:
        load_model(single)
    assert isinstance(caught.value.__cause__, ValueError) or problem.startswith("expected")
    with raises_exactly(CheckpointFileError, f"{config}: {problem}"):       # dtype="auto" on an accelerator
        checkpoint_dtype(single)


def test_a_config_json_transformers_cannot_read_is_named(single):
    config = single / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "wide"}))
    with pytest.raises(CheckpointFileError, match=f"^{re.escape(str(config))}: not a model config transformers "
                                                  f"reads \\(.*hidden_size"):
        load_model(single)


def test_a_truncated_shard_is_named_where_dtype_auto_reads_its_header(single):
    (single / "config.json").write_text(json.dumps({k: v for k, v in json.loads((single / "config.json").read_text())
                                                    .items() if k not in ("dtype", "torch_dtype")}))
    assert checkpoint_dtype(single) == "float32"
    file = single / "model.safetensors"
    before, after = truncate(file, 10)
    with raises_exactly(CheckpointFileError, f"{file}: truncated or corrupt safetensors file "
                                             f"(header says {before} bytes, file has {after})"):
        checkpoint_dtype(single)


def test_a_missing_model_path_is_named(tmp_path):
    with raises_exactly(FileNotFoundError, f"{tmp_path / 'nowhere'}: no such file or folder{FOLDER_HINT}"):
        load_model(tmp_path / "nowhere")
    with raises_exactly(FileNotFoundError, f"{tmp_path}: no config.json{FOLDER_HINT}"):
        load_model(tmp_path)


# ---------------------------------------------------------------- GGUF
def test_a_missing_gguf_path_is_named(tmp_path):
    missing = tmp_path / "absent.gguf"
    for read in (load_model, checkpoint_dtype):
        with raises_exactly(FileNotFoundError, f"{missing}: no such GGUF file"):
            read(missing)


def test_a_truncated_gguf_is_named_with_its_size(gguf_file):
    before, after = truncate(gguf_file, 1000)
    for read in (load_model, checkpoint_dtype):
        with pytest.raises(CheckpointFileError, match=f"^{re.escape(str(gguf_file))}: truncated or corrupt GGUF file "
                                                      f"\\({after} bytes; reading it failed: ") as caught:
            read(gguf_file)
        assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize("content, problem", [
    (b"", "empty file, not a GGUF file"),
    (b"junk that is not a gguf file", "not a GGUF file (it starts with b'junk', not b'GGUF')"),
])
def test_a_garbage_gguf_is_named(gguf_file, content, problem):
    gguf_file.write_bytes(content)
    for read in (load_model, checkpoint_dtype):
        with raises_exactly(CheckpointFileError, f"{gguf_file}: {problem}"):
            read(gguf_file)


# ---------------------------------------------------------------- the doors
def test_llm_and_the_server_start_raise_the_loaders_error_unchanged(single, monkeypatch):
    from jaxengine.serve import __main__ as serve

    file = single / "model.safetensors"
    before, after = truncate(file, 100)
    message = f"{file}: truncated or corrupt safetensors file (header says {before} bytes, file has {after})"
    with raises_exactly(CheckpointFileError, message):
        LLM(str(single), progress=False)
    monkeypatch.setattr(serve, "configure_logging", lambda level: None)      # leave the test's logging alone
    with raises_exactly(CheckpointFileError, message):
        serve.main(["--model", str(single)])
    with raises_exactly(FileNotFoundError, f"{single / 'absent.gguf'}: no such GGUF file"):
        LLM(str(single / "absent.gguf"), progress=False)


# ---------------------------------------------------------------- the tokenizer, generation_config.json

NO_TOKENIZER_HINT = "; give skip_tokenizer_init to run without one (prompts as token ids)"


@pytest.fixture()
def chat(chat_checkpoint, tmp_path):
    """A copy of the tiny Llama with the byte tokenizer, to break."""
    return shutil.copytree(chat_checkpoint, tmp_path / "chat")


@pytest.mark.parametrize("content, problem", [
    (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b'{"version": "1.0", "truncation": null, "padd',
     "not valid JSON (Unterminated string starting at: line 1 column 40 (char 39))"),
    (b"\xff\xfe{}", "not valid JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    (b"[1, 2]", "expected a JSON object, got a list"),
    (b'{"version": "1.0"}', "not a tokenizer file the tokenizers library reads (Model missing. at line 1 column 18)"),
])
def test_a_garbage_tokenizer_json_is_named(chat, content, problem):
    file = chat / "tokenizer.json"
    file.write_bytes(content)
    with raises_exactly(CheckpointFileError, f"{file}: {problem}") as caught:
        load_tokenizer(chat)
    assert caught.value.path == file and caught.value.__cause__ is not None      # transformers' own error


@pytest.mark.parametrize("content, problem", [
    (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b"", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"[1]", "expected a JSON object, got a list"),
])
def test_a_garbage_tokenizer_config_json_is_named(chat, content, problem):
    file = chat / "tokenizer_config.json"
    file.write_bytes(content)
    with raises_exactly(CheckpointFileError, f"{file}: {problem}") as caught:
        load_tokenizer(chat)
    assert caught.value.path == file and caught.value.__cause__ is not None


def test_a_chat_template_that_is_not_text_is_named(chat):
    file = chat / "chat_template.jinja"
    file.write_bytes(b"\xff{%")
    with raises_exactly(CheckpointFileError, f"{file}: not UTF-8 text ('utf-8' codec can't decode byte 0xff in "
                                             f"position 0: invalid start byte)"):
        load_tokenizer(chat)


def test_a_tokenizer_config_transformers_refuses_names_the_folder_and_its_reason(chat):
    """Every file is valid JSON and tokenizer.json loads: no one file is to blame."""
    file = chat / "tokenizer_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "eos_token": 5}))
    with raises_exactly(CheckpointFileError, f"{chat}: its tokenizer does not load (TypeError: Special token "
                                             f"eos_token has to be either str or AddedToken but got: <class 'int'>)"
                                             f"{NO_TOKENIZER_HINT}") as caught:
        load_tokenizer(chat)
    assert isinstance(caught.value.__cause__, TypeError)


def test_a_gguf_without_tokenizer_metadata_is_named(gguf_file):
    with pytest.raises(CheckpointFileError, match=f"^{re.escape(str(gguf_file))}: no tokenizer transformers can "
                                                  f"build from its metadata \\(ValueError: Cannot build a tokenizer "
                                                  f"from a GGUF file stating tokenizer None\\..*\\)"
                                                  f"{re.escape(NO_TOKENIZER_HINT)}$") as caught:
        load_tokenizer(gguf_file)
    assert isinstance(caught.value.__cause__, ValueError)


def test_a_broken_cached_gguf_tokenizer_is_named_with_how_to_rebuild_it(gguf_file, chat):
    cached = converted_cache_path(gguf_file) / "tokenizer"
    shutil.copytree(chat, cached)
    assert load_tokenizer(gguf_file).eos_token_id == 256                 # the cached copy is what loads
    (cached / "tokenizer.json").write_text("{not json")
    with raises_exactly(CheckpointFileError, f"{cached / 'tokenizer.json'}: not valid JSON (Expecting property name "
                                             f"enclosed in double quotes: line 1 column 2 (char 1)); it is the cached "
                                             f"copy of {gguf_file}'s tokenizer: delete {cached} to build it again"):
        load_tokenizer(gguf_file)


@pytest.mark.parametrize("content, problem", [
    (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (b"\x00\x01garbage", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\xff\xfe{}", "not valid JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    (b"[0.7]", "expected a JSON object, got a list"),
])
def test_a_garbage_generation_config_json_is_named(chat, content, problem):
    file = chat / "generation_config.json"
    file.write_bytes(content)
    with raises_exactly(CheckpointFileError, f"{file}: {problem}"):
        generation_defaults("auto", chat)
    with raises_exactly(CheckpointFileError, f"{file}: {problem}"):             # a folder given for the option
        generation_defaults(str(chat), "elsewhere")
    assert generation_defaults("vllm", chat) == {}                              # not read at all


def test_llm_and_the_server_start_name_a_broken_tokenizer_or_generation_config(chat, monkeypatch):
    from jaxengine.serve import __main__ as serve

    monkeypatch.setattr(serve, "configure_logging", lambda level: None)      # leave the test's logging alone
    tokenizer = chat / "tokenizer.json"
    good = tokenizer.read_bytes()
    tokenizer.write_text("[]")
    message = f"{tokenizer}: expected a JSON object, got a list"
    with raises_exactly(CheckpointFileError, message):
        LLM(str(chat), progress=False)
    with raises_exactly(CheckpointFileError, message):
        serve.main(["--model", str(chat)])
    tokenizer.write_bytes(good)
    config = chat / "generation_config.json"
    config.write_text('{"temperature": 0.7,')
    message = f"{config}: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 21 (char 20))"
    with raises_exactly(CheckpointFileError, message):
        LLM(str(chat), progress=False)
    with raises_exactly(CheckpointFileError, message):
        serve.main(["--model", str(chat)])
