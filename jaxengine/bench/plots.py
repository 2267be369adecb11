"""Figures of a benchmark result (not in this build)."""
from __future__ import annotations

from pathlib import Path


def plot_result(result: dict, out_dir) -> list[Path]:
    raise RuntimeError("--plot: figures are not available in this build of jaxengine.bench")
