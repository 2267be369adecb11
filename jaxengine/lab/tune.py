"""The tuner: the engine options that maximise goodput for a workload under latency SLOs.

Goodput is the requests per second that met every SLO (``ttft_ms``, ``itl_ms``, ``tpot_ms``,
``e2e_ms``; a request meets ``itl_ms`` when the 99th percentile of its own gaps does). The search is
coordinate descent over ``SEARCH_SPACE`` from the defaults: each round tries every value of one
option at a time with the others held, keeps the best, and stops when a round changes nothing.
Each trial is one simulation; trials are cached, so a setting is never simulated twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from jaxengine.engine_args import EngineArgs
from jaxengine.lab.simulate import Profile, SimResult, goodput, simulate
from jaxengine.lab.workload import SimRequest, Workload

SEARCH_SPACE: dict[str, list] = {
    "max_num_batched_tokens": [128, 256, 512, 1024, 2048],
    "max_num_seqs": [16, 32, 64, 128],
    "enable_chunked_prefill": [True, False],
    "long_prefill_token_threshold": [0, 64, 256],
    "max_num_partial_prefills": [1, 2, 4],
    "scheduler_delay_factor": [0.0, 0.5, 1.0],
    "watermark": [0.0, 0.01, 0.05],
    "preemption_mode": ["auto", "recompute", "swap"],
}


def speculation_space(max_k: int = 6) -> list:
    """``speculative_config`` values for the search (off, or n-gram with k draft tokens): the tuner
    tries them when it is given the workload's ``acceptance`` (``simulate.fit_acceptance``)."""
    return [None, *({"method": "ngram", "num_speculative_tokens": k} for k in range(1, max_k + 1))]


@dataclass
class Trial:
    options: dict
    goodput: float                      # requests/s meeting every SLO (-inf: the options are invalid)
    summary: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class TuneResult:
    best: Trial
    default: Trial
    trials: list[Trial]
    slos: dict[str, float]

    @property
    def flags(self) -> list[str]:
        """The ``jaxengine.serve`` flags of the best options (only those that differ from the defaults)."""
        return EngineArgs(**self.best.options).to_cli_args()

    @property
    def command(self) -> str:
        return " ".join(["python -m jaxengine.serve", *self.flags])

    def table(self) -> list[dict]:
        """Every trial as one flat row (options, goodput, latency figures), best first."""
        rows = [{**t.options, "goodput": t.goodput, **t.summary} for t in self.trials if t.error is None]
        return sorted(rows, key=lambda r: -r["goodput"])

    def plot_frontier(self, path: str | Path) -> Path:
        """Goodput against p99 TTFT for every trial: the frontier joined, the defaults and the best marked."""
        from jaxengine.bench.plots import new_figure, save_figure

        fig, (ax,) = new_figure()
        ok = [t for t in self.trials if t.error is None and t.summary["ttft_p99_ms"] is not None]
        ax.scatter([t.summary["ttft_p99_ms"] for t in ok], [t.goodput for t in ok], s=12, color="0.6",
                   label="trials (simulated)")
        front = pareto_front(ok)
        ax.plot([t.summary["ttft_p99_ms"] for t in front], [t.goodput for t in front], "-o", ms=4, label="frontier")
        for t, marker, label in ((self.default, "s", "defaults"), (self.best, "*", "tuned")):
            if t in ok:
                ax.plot(t.summary["ttft_p99_ms"], t.goodput, marker, ms=12, label=label)
        ax.set_xscale("log")
        slos = ", ".join(f"{k} <= {v:g}" for k, v in self.slos.items())
        ax.set_title(f"tuner trials (SLOs: {slos})")
        ax.set_xlabel("p99 TTFT (ms)")
        ax.set_ylabel("goodput (req/s)")
        ax.legend(fontsize=8)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_figure(fig, path)


def pareto_front(trials: list[Trial]) -> list[Trial]:
    """Trials no other beats on both goodput (higher) and p99 TTFT (lower), by TTFT."""
    front, best = [], -math.inf
    for t in sorted(trials, key=lambda t: (t.summary["ttft_p99_ms"], -t.goodput)):
        if t.goodput > best:
            front.append(t)
            best = t.goodput
    return front


def tune(workload: Workload | list[SimRequest], profile: Profile, slos: dict[str, float], *,
         space: dict[str, list] | None = None, base_options: dict | None = None, max_rounds: int = 4,
         noise: bool = True, seed: int = 0, progress: bool = True, acceptance: float | None = None) -> TuneResult:
    """Search ``space`` (default ``SEARCH_SPACE``) for the options with the highest goodput.
    ``base_options``: options held fixed and the starting point (default: the engine's defaults).
    ``acceptance``: speculative decoding's acceptance on this workload; given, the search decides
    k or off too (``speculation_space``)."""
    if not slos:
        raise ValueError("slos: give at least one, e.g. {'ttft_ms': 2000, 'itl_ms': 100}")
    space = dict(space or SEARCH_SPACE)
    if acceptance is not None and "speculative_config" not in space:
        space["speculative_config"] = speculation_space()
    unknown = set(space) - set(EngineArgs.__dataclass_fields__)
    if unknown:
        raise ValueError(f"space: not engine options: {sorted(unknown)}")
    cache: dict[tuple, Trial] = {}
    bar = tqdm(desc="tuning", unit="trial", disable=not progress)

    def trial(options: dict) -> Trial:
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        if key not in cache:
            cache[key] = _trial(workload, profile, slos, options, noise, seed, acceptance or 0.0)
            bar.update()
        return cache[key]

    defaults = {name: EngineArgs.__dataclass_fields__[name].default for name in space}
    current = {**defaults, **(base_options or {})}
    default = best = trial(current)
    for _ in range(max_rounds):
        changed = False
        for name, values in space.items():
            for value in values:
                t = trial({**current, name: value})
                if _better(t, best):
                    best, current, changed = t, dict(t.options), True
        if not changed:
            break
    bar.close()
    return TuneResult(best, default, list(cache.values()), dict(slos))


def _better(a: Trial, b: Trial) -> bool:
    """Higher goodput; at equal goodput, lower p99 TTFT."""
    if a.goodput != b.goodput:
        return a.goodput > b.goodput
    return a.error is None and _ttft_p99(a) < _ttft_p99(b)


def _ttft_p99(t: Trial) -> float:
    value = t.summary.get("ttft_p99_ms")
    return math.inf if value is None else value


def _trial(workload, profile: Profile, slos: dict, options: dict, noise: bool, seed: int, acceptance: float) -> Trial:
    try:
        result: SimResult = simulate(workload, profile, slos=slos, noise=noise, seed=seed, acceptance=acceptance,
                                     **options)
    except ValueError as e:                   # e.g. max_num_batched_tokens < max_num_seqs
        return Trial(dict(options), -math.inf, error=str(e))
    return Trial(dict(options), goodput(result), result.summary())
