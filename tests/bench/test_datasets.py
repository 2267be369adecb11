"""The benchmark request sources: seeded and deterministic, lengths as asked, files parsed."""
import json

import pytest

from jaxengine.bench.datasets import (BenchRequest, LengthSpec, prompt_file_requests, random_requests,
                                      shared_prefix_requests, sharegpt_requests)


def byte_encode(text: str) -> list[int]:
    return list(text.encode())


def test_length_specs_parse():
    assert LengthSpec.parse("128") == LengthSpec("fixed", 128)
    assert LengthSpec.parse("32:512") == LengthSpec("uniform", 32, 512)
    assert LengthSpec.parse("lognormal:100") == LengthSpec("lognormal", 100, sigma=0.5)
    assert LengthSpec.parse("lognormal:100:0.25") == LengthSpec("lognormal", 100, sigma=0.25)
    assert [str(LengthSpec.parse(t)) for t in ("128", "32:512", "lognormal:100")] == ["128", "32:512",
                                                                                        "lognormal:100:0.5"]
    for bad in ("0", "x", "9:3", "1:2:3", "lognormal:", "lognormal:10:0"):
        with pytest.raises(ValueError, match="length"):
            LengthSpec.parse(bad)


def test_random_requests_fixed_lengths_are_exact_and_seeded():
    a = random_requests(5, 258, LengthSpec.parse("17"), LengthSpec.parse("9"), seed=3)
    assert [len(r.prompt_token_ids) for r in a] == [17] * 5
    assert [r.output_len for r in a] == [9] * 5
    assert all(0 <= t < 258 for r in a for t in r.prompt_token_ids)
    assert random_requests(5, 258, LengthSpec.parse("17"), LengthSpec.parse("9"), seed=3) == a
    assert random_requests(5, 258, LengthSpec.parse("17"), LengthSpec.parse("9"), seed=4) != a


def test_random_requests_uniform_lengths_cover_the_range():
    requests = random_requests(400, 1000, LengthSpec.parse("3:6"), LengthSpec.parse("1:2"), seed=0)
    assert {len(r.prompt_token_ids) for r in requests} == {3, 4, 5, 6}
    assert {r.output_len for r in requests} == {1, 2}


def test_lognormal_lengths_have_the_mean_asked_and_fit_the_context():
    requests = random_requests(4000, 100, LengthSpec.parse("lognormal:50:0.3"), LengthSpec.parse("lognormal:20"),
                               seed=0, max_model_len=4096)
    prompt_mean = sum(len(r.prompt_token_ids) for r in requests) / len(requests)
    output_mean = sum(r.output_len for r in requests) / len(requests)
    assert abs(prompt_mean - 50) < 1.0 and abs(output_mean - 20) < 1.0
    cut = random_requests(200, 100, LengthSpec.parse("lognormal:50"), LengthSpec.parse("lognormal:50"),
                          seed=0, max_model_len=60)
    assert max(len(r.prompt_token_ids) + r.output_len for r in cut) <= 60
    assert min(min(len(r.prompt_token_ids), r.output_len) for r in cut) >= 1


def test_shared_prefix_requests_share_exactly_the_prefix():
    requests = shared_prefix_requests(4, 50000, 32, LengthSpec.parse("8"), LengthSpec.parse("5"), seed=1)
    prefix = requests[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix and len(r.prompt_token_ids) == 40 for r in requests)
    assert len({tuple(r.prompt_token_ids[32:]) for r in requests}) == 4
    assert [r.output_len for r in requests] == [5] * 4
    assert shared_prefix_requests(4, 50000, 32, LengthSpec.parse("8"), LengthSpec.parse("5"), seed=1) == requests


CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "unprompted"}]},
    {"id": "c", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "why?"},
                                  {"from": "gpt", "value": "because"}, {"from": "human", "value": "ok"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "no answer"}, {"from": "human", "value": "?"}]},
]


@pytest.mark.parametrize("layout", ["json", "jsonl"])
def test_sharegpt_first_human_turn_is_the_prompt_and_the_answer_sets_the_length(tmp_path, layout):
    path = tmp_path / f"share.{layout}"
    if layout == "json":
        path.write_text(json.dumps(CONVERSATIONS))
    else:
        path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    requests = sharegpt_requests(path, byte_encode, seed=0)
    assert sorted(requests, key=lambda r: r.output_len) == [BenchRequest(byte_encode("why?"), 7),
                                                            BenchRequest(byte_encode("hello"), 8)]
    assert sharegpt_requests(path, byte_encode, 2, seed=0) == requests
    assert sharegpt_requests(path, byte_encode, 1, max_model_len=12) == [BenchRequest(byte_encode("why?"), 7)]
    with pytest.raises(ValueError, match="2 usable conversations, 3 needed"):
        sharegpt_requests(path, byte_encode, 3)


def test_prompt_file_takes_text_or_token_ids(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "ab", "max_tokens": 3}, {"prompt": [5, 6, 7]}, {"prompt": "unused", "max_tokens": 1}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert prompt_file_requests(path, byte_encode, 2, default_max_tokens=4) == [
        BenchRequest([97, 98], 3), BenchRequest([5, 6, 7], 4)]
    assert len(prompt_file_requests(path, byte_encode)) == 3
    path.write_text(json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(ValueError, match="record 0"):
        prompt_file_requests(path, byte_encode)
