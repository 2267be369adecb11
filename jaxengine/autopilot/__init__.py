"""The autopilot: given latency targets, the engine chooses its own scheduling knobs every step
from a cost model and the step times it measures (``controller``), and turns new requests away
when the targets cannot be met (``controller.Outlook``)."""
from __future__ import annotations

import logging

from jaxengine.autopilot.controller import OVERLOAD_MARGIN, Autopilot, Outlook, StepPlan
from jaxengine.autopilot.cost import OnlineCost
from jaxengine.engine import Engine
from jaxengine.costmodel.measure import CalibrationGrid, calibrate_engine
from jaxengine.costmodel.profile import CostProfile, load_profile

__all__ = ["OVERLOAD_MARGIN", "STARTUP_GRID", "startup_grid", "Autopilot", "OnlineCost", "Outlook", "StepPlan", "attach_autopilot"]

logger = logging.getLogger(__name__)

# The start-up calibration when no profile is given: seconds on the default model. The online
# correction restates its level within a few steps; the grid gives the shape of the costs.
STARTUP_GRID = CalibrationGrid(contexts=(128,), rows=(1, 8), decode_steps=4)


def startup_grid(engine: Engine) -> CalibrationGrid:
    """``STARTUP_GRID`` within the engine's limits: a shorter context where the model length asks
    for it, fewer rows where ``max_num_seqs`` does."""
    sc = engine.config.scheduler
    room = sc.max_model_len - STARTUP_GRID.decode_steps - 2 * len(engine.runner.token_buckets) - 2
    contexts = tuple(min(c, room) for c in STARTUP_GRID.contexts if room >= 1)
    rows = tuple(sorted({min(r, sc.max_num_seqs - 1) for r in STARTUP_GRID.rows if sc.max_num_seqs > 1}))
    return CalibrationGrid(contexts=contexts or STARTUP_GRID.contexts, rows=rows or (1,),
                           decode_steps=STARTUP_GRID.decode_steps)


def attach_autopilot(engine: Engine, profile: CostProfile | None = None, *, progress: bool = True) -> Autopilot | None:
    """Give ``engine`` the autopilot its configuration asks for (None when it asks for none).
    ``profile``: the cost model (default: the configured ``cost_profile`` file, else a short
    calibration of the engine now, which must then be idle and compiled)."""
    config = engine.config.autopilot
    if config is None:
        return None
    if profile is None and config.cost_profile is not None:
        profile = load_profile(config.cost_profile)
    if profile is None:
        traces = engine.traces                  # the calibration records its own steps
        try:
            profile = calibrate_engine(engine, startup_grid(engine), progress=progress)
        except ValueError as error:
            raise ValueError(f"cost_profile: none given, and calibrating at start-up failed ({error}); give one "
                             f"(python -m jaxengine.lab calibrate)") from None
        finally:
            engine.traces = traces
        logger.info("autopilot: calibrated %d steps (fit error %.0f%% mean)", profile.fit_error.num_steps,
                    profile.fit_error.mean_abs_pct)
    sc = engine.config.scheduler
    token_buckets, row_buckets = engine.config.step_buckets()
    cost = OnlineCost(profile, token_buckets, row_buckets, config.percentile)
    autopilot = engine.planner = Autopilot(config, cost, sc, engine.clock)
    runner = engine.runner
    if hasattr(runner, "num_compiled_buckets"):      # a model runner: learn once every bucket is compiled
        total = len(runner.bucket_pairs())
        autopilot.learning = lambda: runner.num_compiled_buckets >= total
    return autopilot
