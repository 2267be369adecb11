"""``SamplingParams`` and ``BeamSearchParams`` refuse a value of the wrong type (a bool where an
integer is meant, a float for an integer, a string or None for a number) or a non-finite number
up front, with a ValueError naming the field; valid values keep working, as plain ints and floats."""
import math

import numpy as np
import pytest

from jaxengine.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("field, value, message", [
    ("n", True, "n: must be an integer, got True"),
    ("n", 2.0, "n: must be an integer, got 2.0"),
    ("max_tokens", True, "max_tokens: must be None or an integer, got True"),
    ("max_tokens", 4.5, "max_tokens: must be None or an integer, got 4.5"),
    ("best_of", True, "best_of: must be None or an integer, got True"),
    ("min_tokens", True, "min_tokens: must be an integer, got True"),
    ("min_tokens", None, "min_tokens: must be an integer, got None"),
    ("top_k", True, "top_k: must be an integer, got True"),
    ("top_k", 1 << 31, "top_k: must be -1, 0 or a positive integer (at most 2147483647), got 2147483648"),
    ("logprobs", True, "logprobs: must be None or an integer, got True"),
    ("logprobs", 1.0, "logprobs: must be None or an integer, got 1.0"),
    ("prompt_logprobs", False, "prompt_logprobs: must be None or an integer, got False"),
    ("seed", True, "seed: must be None or an integer, got True"),
    ("seed", "abc", "seed: must be None or an integer, got 'abc'"),
    ("seed", 1.5, "seed: must be None or an integer, got 1.5"),
    ("temperature", "hot", "temperature: must be a number, got 'hot'"),
    ("temperature", None, "temperature: must be a number, got None"),
    ("temperature", True, "temperature: must be a number, got True"),
    ("temperature", math.nan, "temperature: must be a finite number, got nan"),
    ("temperature", math.inf, "temperature: must be a finite number, got inf"),
    ("temperature", 10 ** 400, "temperature: must be a finite number, got 100000000000000000...0000000000000000000"),
    ("top_p", "0.9", "top_p: must be a number, got '0.9'"),
    ("top_p", math.nan, "top_p: must be a finite number, got nan"),
    ("min_p", [0.1], "min_p: must be a number, got [0.1]"),
    ("presence_penalty", -math.inf, "presence_penalty: must be a finite number, got -inf"),
    ("frequency_penalty", {}, "frequency_penalty: must be a number, got {}"),
    ("repetition_penalty", math.inf, "repetition_penalty: must be a finite number, got inf"),
    ("logprobs_temperature", math.nan, "logprobs_temperature: must be a finite number, got nan"),
    ("logit_bias", {5: math.nan}, "logit_bias: biases must be numbers in [-100, 100], got [nan]"),
    ("logit_bias", {5: math.inf}, "logit_bias: biases must be numbers in [-100, 100], got [inf]"),
    ("logit_bias", {5: 100.5}, "logit_bias: biases must be numbers in [-100, 100], got [100.5]"),
    ("logit_bias", {5: -101}, "logit_bias: biases must be numbers in [-100, 100], got [-101]"),
    ("logit_bias", {5: "1"}, "logit_bias: biases must be numbers in [-100, 100], got ['1']"),
    ("logit_bias", {5: True}, "logit_bias: biases must be numbers in [-100, 100], got [True]"),
    ("logit_bias", {"5": 1.0}, "logit_bias: keys must be token ids (non-negative integers), got ['5']"),
    ("logit_bias", {True: 1.0}, "logit_bias: keys must be token ids (non-negative integers), got [True]"),
    ("logit_bias", {-1: 1.0}, "logit_bias: keys must be token ids (non-negative integers), got [-1]"),
    ("logit_bias", {2.0: 1.0}, "logit_bias: keys must be token ids (non-negative integers), got [2.0]"),
    ("logit_bias", [5], "logit_bias: must map token ids to biases, got [5]"),
    ("logit_bias", {t: 1.0 for t in range(65)}, "logit_bias: must hold at most 64 entries, got 65"),
    ("stop", 5, "stop: must be a string or a list of strings, got 5"),
    ("stop", {"a": 1}, "stop: must be a string or a list of strings, got {'a': 1}"),
    ("stop", [""], "stop: must be non-empty strings, got ['']"),
    ("stop", ["a", 3], "stop: must be non-empty strings, got ['a', 3]"),
    ("stop_token_ids", [True], "stop_token_ids: must be non-negative integers, got [True]"),
    ("stop_token_ids", [1.0], "stop_token_ids: must be non-negative integers, got [1.0]"),
    ("stop_token_ids", 7, "stop_token_ids: must be non-negative integers, got 7"),
    ("ignore_eos", "yes", "ignore_eos: must be True or False, got 'yes'"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output: must be True or False, got 1"),
    ("skip_special_tokens", None, "skip_special_tokens: must be True or False, got None"),
    ("structured_outputs", {"regex": "a"}, "structured_outputs: must be StructuredOutputsParams, got {'regex': 'a'}"),
])
def test_a_bad_value_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value) == message


def test_valid_values_stay_valid_as_plain_ints_and_floats():
    p = SamplingParams(n=np.int64(2), best_of=2, temperature=np.float32(0.5), top_p=1, top_k=-1, min_p=0,
                       seed=-(1 << 63), presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1.5,
                       logit_bias={np.int64(3): 100, 4: -100.0, 5: 0}, stop="###", stop_token_ids=(1, np.int32(2)),
                       max_tokens=None, min_tokens=np.int16(3), logprobs=20, prompt_logprobs=0,
                       logprobs_temperature=2)
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (2, 2, 0.5, 1.0, -1, 0.0, -(1 << 63))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 2.0, 1.5)
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 0.0} and p.stop == ["###"] and p.stop_token_ids == [1, 2]
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.logprobs_temperature) == (None, 3, 20, 0, 2.0)
    plain = [type(v) for v in (p.n, p.temperature, p.top_p, p.min_tokens, *p.logit_bias, *p.logit_bias.values(),
                               *p.stop_token_ids)]
    assert plain == [int, float, float, int, int, int, int, float, float, float, int, int]
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias={}).stop == []
    assert SamplingParams(seed=(1 << 64) - 1, top_k=(1 << 31) - 1).top_k == (1 << 31) - 1
    regex = StructuredOutputsParams(regex="[ab]+")
    assert SamplingParams(structured_outputs=regex).structured_outputs is regex


@pytest.mark.parametrize("field, value, message", [
    ("length_penalty", math.nan, "length_penalty: must be a finite number, got nan"),
    ("length_penalty", math.inf, "length_penalty: must be a finite number, got inf"),
    ("length_penalty", True, "length_penalty: must be a number, got True"),
    ("temperature", "hot", "temperature: must be a number, got 'hot'"),
    ("temperature", math.nan, "temperature: must be a finite number, got nan"),
    ("beam_width", True, "beam_width: must be an integer in [1, 10], got True"),
    ("max_tokens", 2.0, "max_tokens: must be an integer >= 1, got 2.0"),
    ("ignore_eos", 1, "ignore_eos: must be True or False, got 1"),
    ("stop", 3, "stop: must be a string or a list of strings, got 3"),
    ("structured_outputs", "json", "structured_outputs: must be StructuredOutputsParams, got 'json'"),
])
def test_beam_search_refuses_a_bad_value_naming_its_field(field, value, message):
    with pytest.raises(ValueError) as info:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})
    assert str(info.value) == message


def test_beam_search_keeps_valid_values():
    p = BeamSearchParams(beam_width=np.int64(3), max_tokens=5, temperature=1, length_penalty=-0.5, stop="x",
                         early_stopping="never")
    assert (p.beam_width, p.max_tokens, p.temperature, p.length_penalty, p.stop) == (3, 5, 1.0, -0.5, ["x"])
    assert type(p.beam_width) is int and p.sampling_params().logprobs == 6
