"""The scheduler lab: calibrate a cost profile, simulate workloads through the real scheduler on it,
tune the scheduling options for SLOs, and ask what-if questions of machines that are not here.

    from jaxengine.lab import calibrate, simulate, tune, Workload
    profile = calibrate()                                   # the default model on this machine
    result = simulate(Workload(request_rate=2, num_requests=500), profile, max_num_batched_tokens=256)
    result.summary(); result.plot("figures/")
    tuned = tune(Workload(request_rate=2), profile, {"ttft_ms": 2000, "itl_ms": 100})
    tuned.command                                           # the serve flags to use
"""
from jaxengine.lab.calibrate import CalibrationGrid, calibrate, calibrate_engine, rescale
from jaxengine.lab.capacity import Capacity, capacity
from jaxengine.costmodel.profile import CostProfile, StepShape, constant_profile, load_profile
from jaxengine.costmodel.roofline import RooflineProfile, roofline_profile
from jaxengine.lab.simulate import SimResult, simulate
from jaxengine.lab.tune import SEARCH_SPACE, TuneResult, tune
from jaxengine.lab.workload import SimRequest, Workload, from_bench_result, from_jsonl

__all__ = ["CalibrationGrid", "Capacity", "CostProfile", "RooflineProfile", "SEARCH_SPACE", "SimRequest",
           "SimResult", "StepShape", "TuneResult", "Workload", "calibrate", "calibrate_engine", "capacity",
           "constant_profile", "from_bench_result", "from_jsonl", "load_profile", "rescale", "roofline_profile", "simulate",
           "tune"]
