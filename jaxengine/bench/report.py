"""What every mode shares: result files, tables on the terminal, latency summaries.

A result is one JSON object with ``"mode"`` (``throughput``, ``latency``, ``sweep``, ``serve``)
and, for a run that serves requests, ``"metrics"``: flat figures, among them
``output_tokens_per_s`` and ``e2e_latency_ms`` (a ``summarize`` dict), which a sweep's
throughput-latency frontier reads. The rest is each mode's own (see its module).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

RESULTS_DIR = Path("bench_results")


def result_path(mode: str, result_file: str | None, results_dir: str | Path | None = None) -> Path:
    """``--result-file``, else ``RESULTS_DIR/<mode>-<date>-<time>.json``."""
    if result_file:
        return Path(result_file)
    return Path(results_dir or RESULTS_DIR) / f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_plain) + "\n")
    return path


def _plain(value):
    """numpy scalars and arrays as JSON numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def summarize(values) -> dict:
    """mean, p50, p90, p99 and max of a list of numbers (NaN for none)."""
    a = np.asarray(list(values), float)
    if a.size == 0:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99", "max")}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def print_table(rows: list[dict], title: str | None = None) -> str:
    """Rows of one dict each, as aligned columns (the union of their keys, in order); returns the text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)
