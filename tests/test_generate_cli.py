"""python -m jaxengine.generate: JSONL in, JSONL out, OpenAI batch lines, bad lines reported, resumable."""
import json

import pytest

from jaxengine import SamplingParams
from jaxengine.generate import parse_args, run

CHAT = [{"role": "user", "content": "hi"}]
LINES = [
    {"id": "a", "prompt": "hello", "max_tokens": 5, "ignore_eos": True},
    {"id": "b", "messages": CHAT, "max_tokens": 4, "ignore_eos": True},
    {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "whatever", "messages": CHAT, "max_completion_tokens": 3, "ignore_eos": True}},
    "{not json",
    {"id": "e", "prompt": "x", "temperature": -1},
    "",
    {"id": "f", "prompt": [1, 2, 3], "n": 2, "max_tokens": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True},
    {"prompt": "no id"},
]


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    from jaxengine.llm import LLM

    # the tokens from 16: not a bucket test, and fewer compiles
    return LLM(chat_checkpoint, max_num_batched_tokens=64, token_buckets=[16, 32, 64], request_buckets=[8], max_num_seqs=8, block_size=4,
               max_model_len=128, num_kv_blocks=200, progress=False, compile_mode="eager")


def write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def test_batch_file_with_bad_lines_and_resume(tmp_path, llm, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, LINES)
    args = parse_args(["--input", str(src), "--output", str(dst)])
    assert run(args, llm) == 1
    out = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert sorted(out) == ["a", "b", "c", "f"]
    expected = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out["a"] == {"id": "a", "text": expected[0].outputs[0].text, "prompt_tokens": 5, "completion_tokens": 5,
                        "finish_reason": "length"}
    assert (out["b"]["completion_tokens"], out["c"]["completion_tokens"]) == (4, 3)
    assert out["b"]["prompt_tokens"] == out["c"]["prompt_tokens"] == len(llm.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert len(out["f"]["text"]) == 2 and out["f"]["completion_tokens"] == 4
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith(str(src))]
    assert [e.split(": ", 1)[1].split(":")[0] for e in errors] == ["line 4", "line 5", "line 8"]
    assert "not valid JSON" in errors[0] and "temperature" in errors[1] and "id: missing" in errors[2]

    write(src, LINES[:3] + [{"id": "g", "prompt": "more", "max_tokens": 2, "ignore_eos": True}])
    assert run(args, llm) == 0                                   # resumed: only g is new
    ids = [json.loads(line)["id"] for line in dst.read_text().splitlines()]
    assert ids == ["a", "b", "c", "f", "g"]
