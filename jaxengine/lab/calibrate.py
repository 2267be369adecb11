"""Calibration: load a model, measure this machine's step times over a grid of step shapes
(``measure``) and fit a profile; or restate a profile at this machine's speed now."""
from __future__ import annotations

from jaxengine.engine import Engine
from jaxengine.costmodel.measure import SPEED_CHECK_GRID, CalibrationGrid, calibrate_engine, measure_engine
from jaxengine.costmodel.profile import CostProfile

__all__ = ["SPEED_CHECK_GRID", "CalibrationGrid", "calibrate", "calibrate_engine", "rescale"]


def calibrate(model=None, *, grid: CalibrationGrid | None = None, progress: bool = True, seed: int = 0,
              **engine_options) -> CostProfile:
    """Load ``model`` (a checkpoint path, None for the default model; ``engine_options`` as for
    ``LLM``), measure its steps over ``grid`` and return the fitted profile. Calibrate with the
    largest ``max_num_batched_tokens`` you will simulate: larger buckets are extrapolated."""
    llm = _load(model, progress, engine_options)
    profile = calibrate_engine(llm.engine, grid or CalibrationGrid(), progress=progress, seed=seed,
                               model_config=llm.model_config)
    profile.source.update(model=str(model) if model is not None else "default (SmolLM2-135M-Instruct)",
                          dtype=llm.dtype.name, engine_options=dict(engine_options))
    return profile


def rescale(profile: CostProfile, model=None, *, grid: CalibrationGrid = SPEED_CHECK_GRID, progress: bool = True,
            seed: int = 0, **engine_options) -> CostProfile:
    """``profile`` restated at this machine's speed now: measure the few steps of ``grid`` (a
    minute, against the full grid's minutes) and scale every coefficient by the median of
    measured / predicted. A shared machine's speed drifts by tens of percent over an hour; the
    grid's shape holds, its level does not. The engine options default to the profile's own."""
    llm = _load(model, progress, {**profile.source.get("engine_options", {}), **engine_options})
    shapes, buckets, seconds = measure_engine(llm.engine, grid, progress=progress, seed=seed)
    return profile.scaled_to(shapes, buckets, seconds, "rescaled")


def _load(model, progress: bool, engine_options: dict):
    from jaxengine.llm import LLM

    llm = LLM(model, progress=progress, **engine_options)
    if not isinstance(llm.engine, Engine):
        raise ValueError("calibrate: one engine replica (data_parallel_size=1)")
    llm.wait_until_compiled()           # every bucket measured, none sharing the cores with a compile
    return llm
