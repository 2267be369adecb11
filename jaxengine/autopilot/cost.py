"""The autopilot's cost model: a measured profile's step times, corrected online.

A ``CostProfile`` (the scheduler lab's: fitted per token bucket on a grid of measured steps)
says how a step's time changes with its shape. The machine it runs on drifts (other tenants,
clocks, a server's own output streaming), so ``OnlineCost`` scales it continuously, as the lab's
``CostProfile.scaled_to`` does once: the correction is the median of measured / predicted over
the last ``CORRECTION_WINDOW`` steps, and the spread of those ratios over a longer window gives
the step time at the targets' percentile (``bound``; at most ``MAX_TAIL`` x the median's). A
slowdown shows in the spread at once (its ratios are the window's largest), and in the median
within half the short window.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from jaxengine.costmodel.profile import CostProfile
from jaxengine.costmodel.roofline import RooflineProfile
from jaxengine.costmodel.step_shape import StepShape

CORRECTION_WINDOW = 16      # steps in the median that scales the profile
SPREAD_WINDOW = 256         # steps in the percentile of measured / predicted
# The most the percentile's step time may exceed the median's. A hiccup (a pause of the process,
# another tenant) is no larger for a smaller step: beyond this, shrinking steps buys no latency.
MAX_TAIL = 2.0


class OnlineCost:
    """Step times predicted by ``profile`` (measured, or a roofline model in the simulator) for the
    runner's buckets, corrected by the steps seen."""

    def __init__(self, profile: CostProfile | RooflineProfile, token_buckets: list[int], row_buckets: list[int],
                 percentile: float = 99.0) -> None:
        self.profile = profile
        self.token_buckets, self.row_buckets = list(token_buckets), list(row_buckets)
        self.percentile = percentile
        self._recent: deque[float] = deque(maxlen=CORRECTION_WINDOW)     # measured / profile
        self._spread: deque[float] = deque(maxlen=SPREAD_WINDOW)
        self.correction = 1.0         # the profile's times are scaled by this (median of the recent ratios)
        # the percentile's step time / the median's (>= 1): the profile's own spread until steps are seen
        noise = getattr(profile, "noise_ratio", None)
        self.tail = min(MAX_TAIL, max(1.0, noise(percentile / 100) / noise(0.5))) if noise is not None else 1.0

    def profile_seconds(self, shape: StepShape) -> float:
        """The profile's own prediction for a step of ``shape``, padded as the runner pads it."""
        return self.profile.step_seconds(*shape.bucketed(self.token_buckets, self.row_buckets))

    def predict(self, shape: StepShape) -> float:
        """The step's median time now."""
        return self.profile_seconds(shape) * self.correction

    def bound(self, shape: StepShape) -> float:
        """The step's time at the targets' percentile now."""
        return self.profile_seconds(shape) * self.correction * self.tail

    def observe(self, shape: StepShape, measured_s: float) -> None:
        """A step of ``shape`` took ``measured_s``: update the correction and the spread."""
        predicted = self.profile_seconds(shape)
        if predicted <= 0 or measured_s <= 0:
            return
        ratio = measured_s / predicted
        self._recent.append(ratio)
        self._spread.append(ratio)
        self.correction = statistics.median(self._recent)
        self.tail = min(MAX_TAIL, max(1.0, _quantile(self._spread, self.percentile / 100) / self.correction))


def _quantile(values, q: float) -> float:
    """The ``q`` quantile (nearest rank, upper: a small window errs on the slow side)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1 if q > 0 else 0)]
