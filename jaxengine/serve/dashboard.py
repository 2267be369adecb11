"""The live dashboard (``GET /dashboard``): its page, its settings, and the rolling window it shows.

``DashboardCollector`` rides on the metrics observer calls from the engine thread. Each call is
O(1): a few additions and appends to bounded deques under a lock. The JSON the page polls
(``GET /dashboard/state``) is built only when asked for, from copies taken under the lock, so
the engine thread never waits on it for longer than those copies.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from importlib import resources

import numpy as np

from jaxengine.engine import StepTrace
from jaxengine.parallel.data_parallel import DataParallelEngine

WINDOW_S = 60           # the per-second series, the last-minute sums and the latency percentiles
RATE_S = 5              # output tok/s: the mean of the last few whole seconds, so it follows the load
STEP_HISTORY = 120      # steps in the rolling chart of each step's token budget
MAX_SAMPLES = 20_000    # latency samples kept of each kind (bounds memory and the sort per poll)
PERCENTILES = (50, 90, 99)
# Numeric StepTrace fields, summed per second and since start, of those this engine records.
SUMMED_CANDIDATES = ("num_decode_tokens", "num_prefill_tokens", "num_preemptions", "num_blocks_swapped_in",
                     "num_blocks_swapped_out", "num_swap_fallbacks", "num_rows", "num_prefix_hit_tokens",
                     "step_s", "host_s", "device_idle_s", "num_draft_tokens", "num_accepted_tokens")
SUMMED = tuple(name for name in SUMMED_CANDIDATES if name in StepTrace.__dataclass_fields__)
TRACE_FIELDS = tuple(StepTrace.__dataclass_fields__)
COUNTED = ("steps", "output_tokens", "finished", "overloaded") + SUMMED


def page_html() -> str:
    """The page: one static file, no build step, nothing fetched from elsewhere."""
    return resources.files("jaxengine.serve").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def engine_settings(host) -> dict:
    """What the server runs with: the EngineArgs as given, and what they resolved to."""
    engine = host.engine
    first = engine.replicas[0] if isinstance(engine, DataParallelEngine) else engine
    cache, scheduler = host.config.cache, host.config.scheduler
    resolved = {"max_model_len": scheduler.max_model_len, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "max_num_seqs": scheduler.max_num_seqs, "block_size": cache.block_size,
                "num_gpu_blocks": cache.num_gpu_blocks, "num_cpu_blocks": cache.num_cpu_blocks,
                "async_scheduling": first.async_scheduling, "dtype": str(host.dtype),
                "platform": host.mesh.devices.flat[0].platform, "replicas": host.engine_args.data_parallel_size,
                "scheduling_policy": first.scheduler.policy.name}
    args = dataclasses.asdict(host.engine_args)
    if not isinstance(args["scheduling_policy"], str):     # a policy class or instance given in Python
        args["scheduling_policy"] = repr(args["scheduling_policy"])
    return {"engine_args": args, "resolved": resolved}


def autopilot_targets(engine) -> dict | None:
    """The running autopilot's targets and policy (the first replica's; None without one)."""
    first = engine.replicas[0] if isinstance(engine, DataParallelEngine) else engine
    planner = getattr(first, "planner", None)
    return None if planner is None else dataclasses.asdict(planner.config)


def attainment(samples: list[float], target_s: float | None) -> float | None:
    """The share of the samples within ``target_s`` (None without a target or samples)."""
    if target_s is None or not samples:
        return None
    return sum(1 for v in samples if v <= target_s) / len(samples)


def nearest_rank(p: int, n: int) -> int:
    """The 1-based rank of the p-th percentile of n samples: the smallest sample with at least
    p% of the samples at or below it."""
    return max(-(-p * n // 100), 1)


def summary(values: list[float]) -> dict:
    """Count and nearest-rank percentiles. A partial sort (numpy) puts just those ranks in place:
    Python's full sort of 20,000 samples takes four times as long, on every poll."""
    n = len(values)
    if n == 0:
        return {"count": 0, **{f"p{p}": None for p in PERCENTILES}}
    indices = [nearest_rank(p, n) - 1 for p in PERCENTILES]
    ranked = np.partition(np.fromiter(values, float, n), indices)
    return {"count": n, **{f"p{p}": float(ranked[i]) for p, i in zip(PERCENTILES, indices)}}


class Samples:
    """Timestamped values, oldest first, at most ``limit`` of them (the oldest go first)."""

    def __init__(self, limit: int) -> None:
        self.times: deque[float] = deque(maxlen=limit)
        self.values: deque[float] = deque(maxlen=limit)

    def add(self, t: float, value: float) -> None:
        self.times.append(t)
        self.values.append(value)

    def since(self, start: float) -> list[float]:
        """The values from ``start`` on; older ones are dropped for good."""
        while self.times and self.times[0] < start:
            self.times.popleft()
            self.values.popleft()
        return list(self.values)


class DashboardCollector:
    """Recent steps, per-second sums, latency samples and the queues, for the dashboard.

    The observer calls come from the engine thread; ``snapshot`` from the event loop."""

    def __init__(self, *, window_s: int = WINDOW_S, step_history: int = STEP_HISTORY,
                 max_samples: int = MAX_SAMPLES, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self.started = clock()
        self._lock = threading.Lock()
        self._steps: deque[StepTrace] = deque(maxlen=step_history)
        self._seconds: deque[dict] = deque(maxlen=window_s + 1)     # whole seconds, and the current one
        self._totals = dict.fromkeys(COUNTED, 0)
        self._ttft, self._itl = Samples(max_samples), Samples(max_samples)
        self._queues = {"num_waiting": 0, "num_running": 0, "num_swapped": 0, "kv_usage": 0.0}
        self._replicas: list[dict] = []
        self._expert_tokens: list[int] = []      # a mixture of experts' routed tokens per expert, since start

    # ---- observer calls (engine thread) ----
    def on_step(self, engine) -> None:
        trace, now = engine.last_trace, self.clock()
        replicas = _replica_states(engine)
        with self._lock:
            self._steps.append(trace)
            second = self._second(now)
            self._count(second, "steps", 1)
            for name in SUMMED:
                self._count(second, name, getattr(trace, name))
            self._queues = {"num_waiting": trace.num_waiting, "num_running": trace.num_running,
                            "num_swapped": trace.num_swapped, "kv_usage": trace.kv_usage}
            if replicas is not None:
                self._replicas = replicas
            if trace.expert_tokens:
                if not self._expert_tokens:
                    self._expert_tokens = [0] * len(trace.expert_tokens)
                self._expert_tokens = [a + b for a, b in zip(self._expert_tokens, trace.expert_tokens)]

    def on_tokens(self, request, num_tokens: int, itl: float | None) -> None:
        now, times = self.clock(), request.times
        with self._lock:
            self._count(self._second(now), "output_tokens", num_tokens)
            if itl is not None:
                self._itl.add(now, itl)
            elif times.first_token is not None:         # the request's first delivery
                self._ttft.add(now, times.first_token - times.queued)

    def on_finish(self, request) -> None:
        now = self.clock()
        with self._lock:
            self._count(self._second(now), "finished", 1)

    def on_overload(self) -> None:
        now = self.clock()
        with self._lock:
            self._count(self._second(now), "overloaded", 1)

    def on_idle(self, engine) -> None:
        stats, replicas = engine.stats(), _replica_states(engine)
        with self._lock:
            self._queues = {"num_waiting": stats.num_waiting, "num_running": stats.num_running,
                            "num_swapped": stats.num_swapped, "kv_usage": stats.kv_usage}
            if replicas is not None:
                self._replicas = replicas

    def _second(self, now: float) -> dict:
        """The current second's sums (the lock is held)."""
        second = int(now)
        if not self._seconds or self._seconds[-1]["second"] != second:
            self._seconds.append({"second": second, **dict.fromkeys(COUNTED, 0)})
        return self._seconds[-1]

    def _count(self, second: dict, name: str, amount) -> None:
        """Add to the total since start and to the second's sum (the lock is held)."""
        self._totals[name] += amount
        second[name] += amount

    # ---- the page's poll (event loop) ----
    def snapshot(self, targets: dict | None = None) -> dict:
        """The page's data; ``targets``: the autopilot's (``ttft_s``, ``itl_s``), whose attainment
        over the window it adds (the share of first tokens and of token gaps within each)."""
        now = self.clock()
        with self._lock:
            steps, seconds = list(self._steps), [dict(s) for s in self._seconds]
            totals, queues, replicas = dict(self._totals), dict(self._queues), list(self._replicas)
            expert_tokens = list(self._expert_tokens)
            ttft = self._ttft.since(now - self.window_s)
            itl = self._itl.since(now - self.window_s)
        series = self._per_second(seconds, int(now))
        return {"uptime_s": now - self.started, "window_s": self.window_s, "queues": queues, "replicas": replicas,
                "totals": totals, "recent_steps": {name: [getattr(t, name) for t in steps] for name in TRACE_FIELDS},
                "per_second": series, "last_minute": {name: sum(series[name]) for name in COUNTED},
                "output_tokens_per_s": sum(series["output_tokens"][-RATE_S:]) / RATE_S,
                "latency_s": {"ttft": summary(ttft), "itl": summary(itl)}, "expert_tokens": expert_tokens,
                "slo_attainment": None if targets is None else {
                    "ttft": attainment(ttft, targets["ttft_s"]), "itl": attainment(itl, targets["itl_s"])}}

    def _per_second(self, seconds: list[dict], current: int) -> dict:
        """Each counted quantity over the last ``window_s`` whole seconds, oldest first (0 where
        nothing happened); the current second is left out until it is whole."""
        first = current - self.window_s
        by_second = {s["second"]: s for s in seconds if first <= s["second"] < current}
        empty = dict.fromkeys(COUNTED, 0)
        rows = [by_second.get(second, empty) for second in range(first, current)]
        return {name: [row[name] for row in rows] for name in COUNTED}


def _replica_states(engine) -> list[dict] | None:
    """Each data-parallel replica's queues and KV usage (None for a single engine)."""
    if not isinstance(engine, DataParallelEngine):
        return None
    return [{"num_waiting": s.num_waiting, "num_running": s.num_running, "num_swapped": s.num_swapped,
             "kv_usage": s.kv_usage, "routed": routed}
            for s, routed in zip((r.stats() for r in engine.replicas), engine.num_routed)]
