"""Figures of benchmark results and engine step traces, as PNG files.

``plot_result`` draws whatever series a result holds: latency CDFs from its per-request records
(or its lists of latencies), output tokens per second over time, the step trace when the result
carries one, and for a sweep the throughput-latency frontier. ``plot_trace`` draws per-step
records (``StepTrace`` as dicts): the token budget split, KV usage and queues, preemptions and
swaps, and step timing when the records have it. Figures are drawn on matplotlib's Agg canvas
without pyplot, so nothing here touches a user's interactive backend.
"""
from __future__ import annotations

from pathlib import Path

MODES = ("throughput", "serve", "latency", "sweep")
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SECONDS_LISTS = {"latencies": "latency_ms"}       # lists in seconds not named *_s
THROUGHPUT_KEYS = ("output_throughput", "output_tok_s", "output_tokens_per_s", "tokens_per_s")
FRONTIER_Y = (("ttft_ms", "p99 TTFT (ms)"), ("e2e_ms", "p99 e2e latency (ms)"),
              ("e2e_latency_ms", "p99 e2e latency (ms)"), ("latency_ms", "p99 latency (ms)"))


def plot_result(result: dict, out_dir) -> list[Path]:
    """PNG figures of ``result`` (a benchmark's JSON) in ``out_dir``; -> the paths written."""
    mode = result["mode"]
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    out = _folder(out_dir)
    paths = []
    if mode == "sweep":
        paths += plot_frontier(result, out / "sweep_frontier.png")
        paths += plot_sweep_percentiles(result, out / "sweep_percentiles.png")
    samples = latency_samples(result)
    if samples:
        paths.append(plot_latency_cdfs(samples, out / f"{mode}_latency_cdf.png"))
    series = result.get("throughput_over_time")
    if series and series.get("t_s"):
        paths.append(plot_throughput_over_time(series, out / f"{mode}_throughput_over_time.png"))
    if result.get("trace"):
        paths += plot_trace(result["trace"], out)
    return paths


def _folder(out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def new_figure(rows: int = 1, height: float = 3.2):
    """A figure of ``rows`` stacked axes, drawn without a display (pyplot is never imported)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, squeeze=False)[:, 0]


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG at the resolution of every figure here."""
    fig.savefig(path, dpi=100)
    return path


# ---- latencies ----
def latency_samples(result: dict) -> dict[str, list[float]]:
    """Name -> latencies in ms: from per-request records (ITL gaps pooled), and from top-level
    lists named ``*_ms``, or ``*_s`` and ``latencies`` (seconds, converted)."""
    samples: dict[str, list[float]] = {}
    for record in result.get("requests") or ():
        if record.get("ok", True):
            for key in LATENCY_KEYS:
                value = record.get(key)
                values = value if isinstance(value, list) else [] if value is None else [value]
                samples.setdefault(key, []).extend(values)
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            if key.endswith("_ms"):
                samples[key] = list(value)
            elif key in SECONDS_LISTS or key.endswith("_s"):
                samples[SECONDS_LISTS.get(key, key[:-2] + "_ms")] = [v * 1e3 for v in value]
    return {k: v for k, v in samples.items() if v}


def plot_latency_cdfs(samples: dict[str, list[float]], path: Path) -> Path:
    """One empirical CDF per latency, each on its own axis (their scales differ by orders)."""
    import numpy as np

    fig, axes = new_figure(len(samples), height=2.6)
    for ax, (name, values) in zip(axes, samples.items()):
        v = np.sort(np.asarray(values, dtype=float))
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post")
        ax.set_xlabel(f"{name[:-3]} (ms)")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_throughput_over_time(series: dict, path: Path) -> Path:
    fig, (ax,) = new_figure()
    ax.bar(series["t_s"], series["output_tokens"], width=1.0, align="edge")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens per second")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


# ---- sweep ----
def plot_frontier(result: dict, path: Path) -> list[Path]:
    """Output tok/s against p99 latency, one labelled point per grid point; nothing when the
    points carry no throughput or no latency."""
    points = [p for p in (result.get("points") or result.get("results") or ()) if _throughput(p) is not None]
    panels = [(key, label) for key, label in FRONTIER_Y if any(_p99(p, key) is not None for p in points)]
    if not panels:
        return []
    fig, axes = new_figure(len(panels))
    for ax, (key, label) in zip(axes, panels):
        xy = sorted((_throughput(p), _p99(p, key), _label(p)) for p in points if _p99(p, key) is not None)
        ax.plot([x for x, _, _ in xy], [y for _, y, _ in xy], marker="o")
        for x, y, text in xy:
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return [save_figure(fig, path)]


def plot_sweep_percentiles(result: dict, path: Path) -> list[Path]:
    """For a grid with a numeric first axis: median (dashed) and p99 (solid) TTFT and ITL (TPOT
    offline) against it, one line per value of the second axis; nothing for other grids."""
    grid = result.get("grid") or {}
    points = result.get("points") or []
    if not grid or not points:
        return []
    x_name = next(iter(grid))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in grid[x_name]):
        return []
    panels = [(key, label) for key, label in PERCENTILE_PANELS if any(_percentiles(p, key) for p in points)]
    if not panels:
        return []
    series = {}
    for point in points:
        line = ", ".join(f"{k}={v}" for k, v in point["params"].items() if k != x_name)
        series.setdefault(line, []).append(point)
    fig, axes = new_figure(len(panels))
    for ax, (key, label) in zip(axes, panels):
        for i, (line, members) in enumerate(series.items()):
            xs = [p["params"][x_name] for p in members]
            color = f"C{i}"
            for stat, style in (("median", "--"), ("p99", "-")):
                ys = [(_percentiles(p, key) or {}).get(stat) for p in members]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{line or 'all'} {stat}")
        ax.set_xlabel(x_name)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return [save_figure(fig, path)]


def _percentiles(point: dict, key: str) -> dict | None:
    """{median, p99} of a latency in a grid point's result (serve: median; offline: p50)."""
    value = _metrics(point).get(key)
    if not isinstance(value, dict):
        return None
    median = value.get("median", value.get("p50"))
    return {"median": median, "p99": value.get("p99")} if median is not None else None


def _metrics(point: dict) -> dict:
    """A grid point's measurements: the point itself or its nested ``result`` (an offline
    throughput result keeps them under ``metrics``)."""
    result = point.get("result") if isinstance(point.get("result"), dict) else point
    return result.get("metrics") if isinstance(result.get("metrics"), dict) else result


def _throughput(point: dict) -> float | None:
    m = _metrics(point)
    return next((m[k] for k in THROUGHPUT_KEYS if isinstance(m.get(k), (int, float))), None)


def _p99(point: dict, key: str) -> float | None:
    value = _metrics(point).get(key)
    return value.get("p99") if isinstance(value, dict) else None


PERCENTILE_PANELS = (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("tpot_ms", "TPOT (ms)"))


def _label(point: dict) -> str:
    if "label" in point:
        return str(point["label"])
    params = point.get("params") or point.get("config") or {}
    return ", ".join(f"{k}={v}" for k, v in params.items())


# ---- step traces ----
def plot_trace(records: list[dict], out_dir) -> list[Path]:
    """Figures of per-step trace records; x is ``time`` (s from the first step) when the records
    have it, else the step index. Fields a record lacks are left out."""
    if not records:
        return []
    out = _folder(out_dir)
    x, xlabel = _trace_x(records)
    paths = [plot_token_budget(records, x, xlabel, out / "trace_tokens.png"),
             plot_kv_and_queues(records, x, xlabel, out / "trace_kv_queues.png")]
    for path, fields, ylabel in (
            (out / "trace_preemptions.png", ("num_preemptions", "num_blocks_swapped_in", "num_blocks_swapped_out",
                                             "num_swap_fallbacks"), "per step"),
            (out / "trace_step_time.png", ("step_s", "host_s", "device_idle_s"), "seconds")):
        present = [f for f in fields if f in records[0]]
        if present:
            paths.append(plot_fields(records, x, xlabel, present, ylabel, path))
    return paths


def _trace_x(records: list[dict]) -> tuple[list[float], str]:
    if "time" in records[0]:
        t0 = records[0]["time"]
        return [r["time"] - t0 for r in records], "time (s)"
    return [r.get("step", i) for i, r in enumerate(records)], "step"


def _column(records: list[dict], name: str) -> list[float]:
    return [r.get(name, 0) for r in records]


def plot_token_budget(records: list[dict], x: list[float], xlabel: str, path: Path) -> Path:
    """Each step's tokens, decode under prefill (stacked); prefix-cache hits as a line: those
    tokens were not computed, so they are not part of the budget."""
    import numpy as np

    fig, (ax,) = new_figure()
    decode = np.asarray(_column(records, "num_decode_tokens"), dtype=float)
    prefill = np.asarray(_column(records, "num_prefill_tokens"), dtype=float)
    ax.fill_between(x, 0, decode, step="post", label="decode", alpha=0.8)
    ax.fill_between(x, decode, decode + prefill, step="post", label="prefill", alpha=0.8)
    if "num_prefix_hit_tokens" in records[0]:
        ax.step(x, _column(records, "num_prefix_hit_tokens"), where="post", color="black", linestyle="--",
                label="prefix-cache hits")
    _finish(ax, xlabel, "tokens per step")
    return save_figure(fig, path)


def plot_kv_and_queues(records: list[dict], x: list[float], xlabel: str, path: Path) -> Path:
    fig, (kv, queues) = new_figure(2)
    kv.step(x, _column(records, "kv_usage"), where="post", label="KV usage")
    kv.set_ylim(0, 1.02)
    _finish(kv, xlabel, "fraction of KV blocks")
    for name in ("num_waiting", "num_running", "num_swapped"):
        if name in records[0]:
            queues.step(x, _column(records, name), where="post", label=name[len("num_"):])
    _finish(queues, xlabel, "requests")
    return save_figure(fig, path)


def plot_fields(records: list[dict], x: list[float], xlabel: str, fields: list[str], ylabel: str,
                path: Path) -> Path:
    fig, (ax,) = new_figure()
    for name in fields:
        ax.step(x, _column(records, name), where="post", label=name.removeprefix("num_"))
    _finish(ax, xlabel, ylabel)
    return save_figure(fig, path)


def _finish(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
