import pytest

from jaxengine.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxengine.core.scheduler import Scheduler
from jaxengine.request import Request, RequestStatus, check_stop
from jaxengine.sampling_params import SamplingParams

from tests.helpers import Harness


def stop_after(tokens, eos=0, **params):
    """Append tokens one by one; return (number appended, status) at the first stop."""
    request = Request("r", [5, 6], SamplingParams(**params), eos_token_id=eos)
    request.max_output_tokens = params.get("max_tokens") or 1 << 62
    seq = request.seqs[0]
    for i, t in enumerate(tokens, 1):
        seq.token_ids.append(t)
        status = check_stop(request, seq, t)
        if status is not None:
            return i, status, seq.stop_reason
    return len(tokens), None, None


def test_eos_stops_unless_ignored_and_not_before_min_tokens():
    assert stop_after([3, 0, 4], max_tokens=10) == (2, RequestStatus.FINISHED_STOPPED, 0)
    assert stop_after([3, 0, 4], max_tokens=10, ignore_eos=True) == (3, None, None)
    assert stop_after([0, 0, 0], max_tokens=10, min_tokens=3) == (3, RequestStatus.FINISHED_STOPPED, 0)


def test_stop_token_ids_and_max_tokens():
    assert stop_after([3, 9, 4], max_tokens=10, stop_token_ids=[9]) == (2, RequestStatus.FINISHED_STOPPED, 9)
    assert stop_after([9, 9], max_tokens=10, stop_token_ids=[9], min_tokens=2) == (2, RequestStatus.FINISHED_STOPPED, 9)
    assert stop_after([3, 4, 5, 6], max_tokens=3) == (3, RequestStatus.FINISHED_LENGTH, None)


def test_max_model_len_caps_the_output():
    h = Harness(max_model_len=10)
    r = h.add("r", 7, max_tokens=100)
    h.run()
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 10
    assert r.status.finish_reason == "length"
    full = h.add("full", 10, max_tokens=100)        # a prompt of exactly max_model_len leaves no room
    assert full.status is RequestStatus.FINISHED_IGNORED and full.output_token_ids == []


def test_request_timestamps_are_recorded_in_order():
    h = Harness()
    r = h.add("r", 4, max_tokens=2, arrival=0.0)
    h.clock.now = 1.0
    h.step()
    h.clock.now = 2.0
    h.step()
    assert (r.times.queued, r.times.first_scheduled, r.times.first_token, r.times.finished) == (0.0, 1.0, 1.0, 2.0)


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "n: must be an integer >= 1"),
    ("temperature", -0.1, "temperature: must be >= 0"),
    ("top_p", 0.0, "top_p: must be in (0, 1]"),
    ("top_k", -2, "top_k"),
    ("max_tokens", 0, "max_tokens"),
    ("min_p", 1.5, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("logprobs", -1, "logprobs"),
    ("best_of", -1, "best_of: must be None or an integer >= 1"),
    ("best_of", 0, "best_of: must be None or an integer >= 1"),
])
def test_sampling_params_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_best_of_must_be_n():
    with pytest.raises(ValueError, match=r"best_of: must be >= n \(3\), got 2"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=r"best_of: above n \(1\) is not supported"):
        SamplingParams(best_of=2)
    assert SamplingParams(n=2, best_of=2).best_of == 2 and SamplingParams(n=2).best_of is None


def test_min_tokens_above_max_tokens_is_refused_and_stop_string_is_listed():
    with pytest.raises(ValueError, match="min_tokens: must be <= max_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    assert SamplingParams(stop="###").stop == ["###"]


def test_empty_or_non_integer_prompt_is_refused():
    with pytest.raises(ValueError, match="prompt_token_ids: must not be empty"):
        Request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids: must be non-negative integers"):
        Request("r", [1, -2], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids: must be non-negative integers"):
        Request("r", [1, "a"], SamplingParams())


def test_finish_request_from_outside_needs_a_finished_status():
    h = Harness()
    h.add("r", 4)
    with pytest.raises(ValueError, match="status: RUNNING is not a finished status"):
        h.scheduler.finish_request("r", RequestStatus.RUNNING)
    assert h.scheduler.finish_request("r", RequestStatus.FINISHED_STOPPED, "stop string")
    assert h.requests["r"].status_reason == "stop string" and h.kv.num_free_blocks == h.kv.num_usable_blocks


@pytest.mark.parametrize("make, message", [
    (lambda: SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens: must be >= max_num_seqs"),
    (lambda: Scheduler(SchedulerConfig(policy="lifo"), CacheConfig()), "policy: must be one of"),  # made there
    (lambda: SchedulerConfig(preemption_mode="drop"), "preemption_mode: must be one of"),
    (lambda: CacheConfig(num_gpu_blocks=1), "num_gpu_blocks: must be >= 2"),
    (lambda: CacheConfig(watermark=1.0), "watermark: must be in"),
    (lambda: EngineConfig().replace(block_sise=4), r"unknown option\(s\) \['block_sise'\]"),
])
def test_config_errors_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_prompt_and_output_never_pass_max_model_len():
    h = Harness(max_model_len=10)
    fills = h.add("fills", 9, max_tokens=None)
    full = h.add("full", 10, max_tokens=None)
    assert full.status is RequestStatus.FINISHED_IGNORED and full.output_token_ids == []
    assert "leaves no room for output within max_model_len=10" in full.status_reason
    h.run()
    assert fills.status is RequestStatus.FINISHED_LENGTH and fills.num_tokens == 10
    assert len(fills.output_token_ids) == 1
