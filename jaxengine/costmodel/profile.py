"""Cost profiles: how long one engine step takes, as a function of the step's shape.

A ``StepShape`` is what a step costs by: its scheduled tokens (padded by the runner to a token
bucket), its rows (padded to a row bucket), the longest context a row attends to and the
attended contexts summed. ``CostProfile`` is fitted from measured steps (``calibrate`` or a
recorded step trace): for each token bucket a non-negative linear model

    step_s = c0 + c_pre * prefill_step + c_rows * row_bucket + c_max * max_context + c_sum * sum_context
             + c_moe * routed_pairs

(``prefill_step`` is 1 for a step that runs prompt tokens: admissions and prompt chunks cost the
host more than decodes. A step computes its whole padded bucket, so within a bucket the real
token count is left out: fitted, it soaks up noise and biased predictions of served steps by
10-15% on this project's CPU machine. On the CPU the plain-jnp attention loops over the longest context's pages for every
padded token, so ``max_context`` carries it; a paged kernel's cost follows ``sum_context``; the
sampler's follows the padded rows). A mixture of experts runs its experts on the real tokens only,
not on the padding: ``routed_pairs`` is the step's token-expert pairs (tokens x top-k x sparse
layers, from the profile's ``routed_pairs_per_token``; 0 for a dense model). A bucket
that was not measured takes its coefficients by linear interpolation in the bucket size between
the nearest measured ones (linear extrapolation past the largest, the smallest's below it). The profile keeps the spread of
measured / predicted times, which the simulator may draw from so that tails are not too tidy.

``jaxengine.costmodel.roofline.RooflineProfile`` answers the same question from datasheet figures
(bandwidth, FLOP/s) for a machine that is not here: a model, not a measurement, and it says so.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxengine.costmodel.step_shape import StepShape, write_json

if TYPE_CHECKING:
    from jaxengine.costmodel.roofline import RooflineProfile

FEATURES = ("const", "prefill_step", "row_bucket", "max_context", "sum_context", "routed_pairs")
NOISE_QUANTILES = 41          # measured/predicted ratios kept: the 0th, 2.5th, ..., 100th percentiles


@dataclass
class FitError:
    """How well a profile predicts the steps it was fitted on (percent of the measured time)."""

    num_steps: int
    mean_abs_pct: float
    p50_abs_pct: float
    p90_abs_pct: float
    max_abs_pct: float

    @classmethod
    def of(cls, measured: np.ndarray, predicted: np.ndarray) -> "FitError":
        err = np.abs(predicted - measured) / measured * 100
        return cls(len(err), float(err.mean()), float(np.percentile(err, 50)), float(np.percentile(err, 90)),
                   float(err.max()))


@dataclass
class CostProfile:
    """Measured step costs of one model on one machine (see the module docstring)."""

    coefficients: dict[int, list[float]]          # token bucket -> one coefficient per FEATURES
    num_gpu_blocks: int                           # the KV pool the calibration engine had
    block_size: int = 16
    num_cpu_blocks: int = 0
    max_model_len: int = 2048
    noise: list[float] = field(default_factory=list)   # quantiles of measured / predicted (empty: none)
    swap_s_per_block: float = 0.0
    request_overhead_s: float = 0.0               # added to every arrival: the request's way into the engine
    fit_error: FitError | None = None
    source: dict = field(default_factory=dict)    # what was measured where: model, machine, options, date
    kind: str = "measured"
    routed_pairs_per_token: int = 0               # a mixture of experts' top-k x sparse layers (0: dense)
    num_params: int = 0                           # the model's parameters, and those a token runs through
    num_active_params: int = 0
    # the model's layer groups' windows (``CacheConfig.group_windows``): a simulation's pool slides as its did
    group_windows: tuple = (None,)

    def __post_init__(self) -> None:
        # a profile of fewer features (a file of an earlier version): the rest cost nothing
        self.coefficients = {int(k): list(map(float, v)) + [0.0] * (len(FEATURES) - len(v))
                             for k, v in self.coefficients.items()}
        if not self.coefficients:
            raise ValueError("coefficients: a profile needs at least one token bucket")
        if isinstance(self.fit_error, dict):
            self.fit_error = FitError(**self.fit_error)
        self.group_windows = tuple(self.group_windows)       # (a list, read from a file)
        self._buckets = sorted(self.coefficients)
        self._cache: dict[int, np.ndarray] = {}

    # ---- prediction ----
    def step_seconds(self, shape: StepShape, token_bucket: int) -> float:
        """The predicted time of a step of ``shape`` padded to ``token_bucket`` tokens."""
        c = self._at(token_bucket)
        f = shape.features(self.routed_pairs_per_token)
        seconds = c[0] + c[1] * f[1] + c[2] * f[2] + c[3] * f[3] + c[4] * f[4] + c[5] * f[5]
        return max(seconds, 0.0) + self.swap_s_per_block * shape.num_swapped_blocks

    def _at(self, bucket: int) -> np.ndarray:
        c = self._cache.get(bucket)
        if c is None:
            c = self._cache[bucket] = self._interpolate(bucket)
        return c

    def _interpolate(self, bucket: int) -> np.ndarray:
        b = self._buckets
        if bucket in self.coefficients:
            return np.asarray(self.coefficients[bucket])
        if bucket < b[0] or len(b) == 1:           # below the smallest measured: no cheaper than it
            return np.asarray(self.coefficients[b[0]])
        i = min(max(bisect.bisect_left(b, bucket), 1), len(b) - 1)
        lo, hi = b[i - 1], b[i]
        w = (bucket - lo) / (hi - lo)
        c = (1 - w) * np.asarray(self.coefficients[lo]) + w * np.asarray(self.coefficients[hi])
        return np.maximum(c, 0.0)

    def noise_ratio(self, u: float) -> float:
        """The measured/predicted ratio at quantile ``u`` in [0, 1] (1 without noise)."""
        if not self.noise:
            return 1.0
        x = u * (len(self.noise) - 1)
        i = min(int(x), len(self.noise) - 2)
        return self.noise[i] + (x - i) * (self.noise[i + 1] - self.noise[i])

    # ---- fitting ----
    @classmethod
    def fit(cls, shapes: list[StepShape], buckets: list[int], seconds: list[float], **kwargs) -> "CostProfile":
        """Fit per-bucket coefficients to measured steps (``buckets``: each step's token bucket)."""
        if not shapes:
            raise ValueError("no steps to fit a profile to")
        x = np.asarray([s.features(kwargs.get("routed_pairs_per_token", 0)) for s in shapes], float)
        y = np.asarray(seconds, float)
        b = np.asarray(buckets)
        coefficients = {int(k): nonnegative_lstsq(x[b == k], y[b == k]).tolist() for k in np.unique(b)}
        profile = cls(coefficients, **kwargs)
        predicted = np.asarray([profile.step_seconds(s, k) for s, k in zip(shapes, buckets)])
        ratio = y / np.maximum(predicted, 1e-9)
        profile.noise = np.quantile(ratio, np.linspace(0, 1, NOISE_QUANTILES)).tolist()
        profile.fit_error = FitError.of(y, predicted)
        return profile

    @classmethod
    def from_trace(cls, records, token_buckets: list[int], request_buckets: list[int], *, num_gpu_blocks: int,
                   skip: int = 1, **kwargs) -> "CostProfile":
        """Fit to a recorded step trace (``StepTrace`` records or their dicts; ``read_trace`` reads a
        file). ``token_buckets``, ``request_buckets``: the engine's (``buckets``); the first
        ``skip`` steps are left out (they may carry compilation). Records need ``max_context_len``."""
        shapes, buckets, seconds = trace_points(records, token_buckets, request_buckets, skip)
        return cls.fit(shapes, buckets, seconds, num_gpu_blocks=num_gpu_blocks, **kwargs)

    def adjusted_to_trace(self, records, token_buckets: list[int], request_buckets: list[int],
                          skip: int = 1) -> "CostProfile":
        """This profile scaled to the steps of a recorded trace: the calibration grid gives how a
        step's time changes with its shape, the trace (a server under its real load: output
        streaming, clients on the same cores) gives the level and the spread."""
        shapes, buckets, seconds = trace_points(records, token_buckets, request_buckets, skip)
        return self.scaled_to(shapes, buckets, seconds, "adjusted_to_trace", spread=True)

    def scaled_to(self, shapes: list[StepShape], buckets: list[int], seconds: list[float], note: str,
                  spread: bool = False) -> "CostProfile":
        """Every coefficient multiplied by the median of measured / predicted over these steps
        (recorded in ``source[note]``); with ``spread`` the noise becomes theirs too. A machine's
        speed drifts (other tenants, clocks): a few steps measured now restate a grid measured
        earlier at today's level."""
        predicted = np.asarray([self.step_seconds(s, b) for s, b in zip(shapes, buckets)])
        if not len(predicted):
            raise ValueError("no steps to scale the profile to")
        ratio = np.asarray(seconds) / np.maximum(predicted, 1e-9)
        factor = float(np.median(ratio))
        prefill = np.asarray([s.num_prefill_tokens > 0 for s in shapes], bool)
        by_kind = {kind: float(np.median(ratio[mask])) for kind, mask in (("prefill", prefill), ("decode", ~prefill))
                   if mask.any()}
        noise = np.quantile(ratio / factor, np.linspace(0, 1, NOISE_QUANTILES)).tolist() if spread else self.noise
        profile = dataclasses.replace(self, coefficients={b: [c * factor for c in v] for b, v in self.coefficients.items()},
                                      noise=noise, source={**self.source, note: {"factor": factor, "num_steps": len(seconds),
                                                                                 "median_ratio": by_kind}})
        profile.fit_error = FitError.of(np.asarray(seconds), predicted * factor)
        return profile

    # ---- files ----
    def to_dict(self) -> dict:
        d = asdict(self)
        d["coefficients"] = {str(k): v for k, v in self.coefficients.items()}
        d["features"] = list(FEATURES)
        return d

    def save(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        d = {k: v for k, v in d.items() if k != "command"}      # a calibrate result file is a profile too
        if d.get("kind") == "roofline":
            raise ValueError("a roofline profile: load it with load_profile")
        features = d.pop("features", list(FEATURES))
        if list(features) != list(FEATURES)[:len(features)]:
            raise ValueError(f"features: this version reads {list(FEATURES)}, the file has {features}")
        return cls(**d)


def trace_points(records, token_buckets: list[int], request_buckets: list[int], skip: int = 0):
    """(shapes padded to their row buckets, token buckets, seconds) of a trace's steps with
    tokens, less the first ``skip``: what a profile is fitted to."""
    shapes, buckets, seconds = [], [], []
    for record in list(records)[skip:]:
        shape = StepShape.of_trace(record)
        step_s = record["step_s"] if isinstance(record, dict) else record.step_s
        if shape.num_tokens == 0 or step_s <= 0:
            continue
        if shape.max_context == 0:
            raise ValueError("trace records lack max_context_len: record the trace with this engine version")
        shape, bucket = shape.bucketed(token_buckets, request_buckets)
        shapes.append(shape)
        buckets.append(bucket)
        seconds.append(step_s)
    if not seconds:
        raise ValueError("the trace has no steps with tokens to fit")
    return shapes, buckets, seconds


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best fit over subsets of the features
    (exact for the few features here), so no cost ever goes down as a step grows."""
    n = x.shape[1]
    best, best_err = np.zeros(n), math.inf
    if len(y) == 0:
        return best
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((x[:, cols] @ coef - y) ** 2))
            if err < best_err - 1e-18:
                best, best_err = np.zeros(n), err
                best[cols] = coef
    return best


def constant_profile(step_s: float, *, num_gpu_blocks: int = 1024, **kwargs) -> CostProfile:
    """Every step takes ``step_s`` seconds (tests, hand-computed timelines)."""
    return CostProfile({1: [step_s] + [0.0] * (len(FEATURES) - 1)}, num_gpu_blocks=num_gpu_blocks, kind="constant", **kwargs)


def machine_description() -> dict:
    """Where a profile was measured."""
    import os

    return {"machine": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def load_profile(path: str | Path) -> CostProfile | RooflineProfile:
    """A profile JSON written by ``calibrate`` (or ``save``), measured or a roofline model."""
    from jaxengine.costmodel.roofline import RooflineProfile

    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"profile: cannot read {path}: {e}") from None
    if d.get("kind") == "roofline":
        return RooflineProfile(**{k: v for k, v in d.items() if k != "command"})
    return CostProfile.from_dict(d)
