"""Capacity: the highest request rate a deployment sustains within its SLOs, found by simulation.

Used on a measured profile it answers "how much traffic does this machine take"; on a
``RooflineProfile`` (a machine that is not here) it is a what-if: a model, not a measurement.
"""
from __future__ import annotations

import dataclasses
import math

from jaxengine.lab.simulate import Profile, SimResult, simulate, slo_attainment
from jaxengine.lab.workload import Workload


@dataclasses.dataclass
class Capacity:
    requests_per_s: float               # the highest rate found that meets ``attainment``
    attainment: float                   # share of requests within every SLO at that rate
    summary: dict                       # the simulation at that rate (SimResult.summary())
    probes: list[tuple[float, float]]   # (rate, attainment) of every simulation run
    note: str                           # what kind of figure this is

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def capacity(workload: Workload, profile: Profile, slos: dict[str, float], *, attainment: float = 0.9,
             low: float = 0.05, high: float = 1000.0, rel_tol: float = 0.05, seed: int = 0,
             **engine_options) -> Capacity:
    """The highest Poisson request rate (within ``rel_tol``) at which at least ``attainment`` of
    ``workload``'s requests meet every SLO; ``workload.request_rate`` is what this searches."""
    if not slos:
        raise ValueError("slos: capacity is defined by SLOs; give at least one")
    probes: list[tuple[float, float]] = []
    runs: dict[float, SimResult] = {}

    def meets(rate: float) -> bool:
        result = simulate(dataclasses.replace(workload, request_rate=rate), profile, slos=slos, seed=seed,
                          **engine_options)
        runs[rate] = result
        probes.append((rate, slo_attainment(result)))
        return probes[-1][1] >= attainment

    if not meets(low):
        return _capacity(0.0, low, runs, probes, profile)
    lo, hi = low, low * 2
    while hi < high and meets(hi):
        lo, hi = hi, hi * 2
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return _capacity(lo, lo, runs, probes, profile)


def _capacity(rate: float, probed: float, runs: dict, probes: list, profile: Profile) -> Capacity:
    result = runs[probed]
    kind = getattr(profile, "kind", "measured")
    note = getattr(profile, "note", None) or f"simulated on a {kind} profile of this machine"
    return Capacity(rate, slo_attainment(result), result.summary(), probes, note)
