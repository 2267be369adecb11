"""The autopilot's options: EngineArgs fields and flags, the per-request targets, clear errors."""
import pytest

from jaxengine.autopilot import attach_autopilot
from jaxengine.config import AutopilotConfig
from jaxengine.engine import Engine
from jaxengine.engine_args import EngineArgs
from jaxengine.lab import constant_profile
from jaxengine.costmodel.roofline import roofline_profile
from jaxengine.request import LatencyTargets
from jaxengine.testing.fake_runner import HashRunner


def test_a_target_turns_the_autopilot_on_unless_it_is_turned_off():
    assert EngineArgs().autopilot_config() is None
    assert EngineArgs(slo_itl_ms=50, slo_ttft_ms=2000).autopilot_config() == AutopilotConfig(
        ttft_s=2.0, itl_s=0.05, percentile=99.0, overload_policy="reject", cost_profile=None)
    assert EngineArgs(slo_itl_ms=50, autopilot=False).autopilot_config() is None
    args = EngineArgs(slo_ttft_ms=800, slo_percentile=90, overload_policy="queue", cost_profile="p.json")
    assert args.autopilot_config() == AutopilotConfig(ttft_s=0.8, percentile=90, overload_policy="queue",
                                                      cost_profile="p.json")
    assert args.to_cli_args() == ["--slo-ttft-ms", "800", "--slo-percentile", "90", "--cost-profile", "p.json",
                                  "--overload-policy", "queue"]


@pytest.mark.parametrize("options, message", [
    (dict(autopilot=True), "autopilot: needs a latency target (slo_ttft_ms and/or slo_itl_ms)"),
    (dict(slo_ttft_ms=0), "slo_ttft_ms: must be > 0 ms, got 0"),
    (dict(slo_itl_ms=-5), "slo_itl_ms: must be > 0 ms, got -5"),
    (dict(slo_itl_ms=50, slo_percentile=0), "slo_percentile: must be in (0, 100], got 0"),
    (dict(slo_itl_ms=50, overload_policy="drop"), "overload_policy: must be one of ['reject', 'queue'], got 'drop'"),
])
def test_bad_options_are_errors_naming_the_option(options, message):
    with pytest.raises(ValueError) as error:
        EngineArgs(**options)
    assert str(error.value) == message


@pytest.mark.parametrize("targets, message", [
    ({"ttft": 5}, "slo: unknown key(s) ['ttft']; known: ['itl_ms', 'ttft_ms']"),
    ({"itl_ms": 0}, "slo.itl_ms: must be a number > 0 (milliseconds), got 0"),
    ({"ttft_ms": "fast"}, "slo.ttft_ms: must be a number > 0 (milliseconds), got 'fast'"),
])
def test_a_requests_own_targets_are_checked(targets, message):
    with pytest.raises(ValueError) as error:
        LatencyTargets.from_ms(targets)
    assert str(error.value) == message


def test_a_requests_own_targets_in_seconds():
    assert LatencyTargets.from_ms({"ttft_ms": 1500, "itl_ms": None}) == LatencyTargets(1.5, None)
    assert LatencyTargets.from_ms(None) is None and LatencyTargets.from_ms({}) is None


def engine(**options) -> Engine:
    config = EngineArgs(**options).engine_config(64, 0, 256)
    return Engine(config, HashRunner(64, 0, 16))


def test_a_profile_that_cannot_be_read_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^profile: cannot read .*missing.json"):
        attach_autopilot(engine(slo_itl_ms=50, cost_profile=str(tmp_path / "missing.json")))


def test_the_configured_profile_is_loaded_and_the_configured_limits_are_ceilings(tmp_path):
    path = constant_profile(0.01).save(tmp_path / "profile.json")
    e = engine(slo_itl_ms=50, cost_profile=str(path), max_num_batched_tokens=256, max_num_seqs=32)
    autopilot = attach_autopilot(e)
    assert e.planner is autopilot and autopilot.cost.profile.kind == "constant"
    assert autopilot.cost.token_buckets[-1] == 256 and autopilot.cost.row_buckets[-1] == 32
    plan = autopilot.plan(e.scheduler, None)
    assert plan.limits == (256, 32) and plan.knobs.max_num_seqs_admitted == 32     # nothing queued: the ceilings
    assert attach_autopilot(engine()) is None        # no target: no autopilot


def test_a_roofline_profile_drives_the_simulated_autopilot_too():
    e = engine(slo_itl_ms=50)
    autopilot = attach_autopilot(e, roofline_profile())
    assert autopilot.cost.tail == 1.0                 # a model: no measured spread
    e.add_request("a", list(range(1, 100)))
    e.step()
    assert e.last_trace.autopilot_budget > 0 and e.last_trace.predicted_step_s > 0
