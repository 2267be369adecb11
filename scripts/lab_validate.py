"""The scheduler lab against measurement: for each engine configuration and request rate, serve the
workload for real (``python -m jaxengine.bench serve --launch``) and simulate it on a cost profile
(``python -m jaxengine.lab calibrate``), then put predicted and measured TTFT / ITL medians and
p99s side by side, with their latency CDFs in one figure per configuration.

    python scripts/lab_validate.py --profile lab_results/profile.json --out docs/bench/lab

Both sides get the same requests: the bench tool's prompts of random token ids (fixed length,
``ignore_eos``) and its arrival times (same rate, seed and gaps). Right before each served run the
profile is rescaled to the machine's speed at that moment (``calibrate --profile``, a minute of
measured steps; ``--no-rescale`` simulates on the profile as given): a shared machine's speed
drifts by tens of percent within the half hour the runs take. Each served run also records its
step trace, and every point is predicted a second time with the profile's level taken from that
run's own steps (``CostProfile.scaled_to``): the machine's speed during the run known, what is
left is the simulator's. A prediction is the median over ``--sim-seeds`` draws of the profile's
step-time spread (the p99 of a few dozen requests is nearly their maximum: one draw is noisy).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxengine.bench.report import print_table, write_result
from jaxengine.costmodel.profile import load_profile, trace_points
from jaxengine.lab.simulate import simulate
from jaxengine.lab.workload import Workload
from jaxengine.trace import read_trace

KEYS, STATS = ("ttft_ms", "itl_ms"), ("median", "p99")
CONFIGS = {
    "budget 256, chunked": {"max_num_batched_tokens": 256},
    "budget 1024, delay factor 1": {"max_num_batched_tokens": 1024, "scheduler_delay_factor": 1.0},
    "budget 1024, whole prefills": {"max_num_batched_tokens": 1024, "enable_chunked_prefill": False},
}


def flags(options: dict) -> list[str]:
    from jaxengine.engine_args import EngineArgs

    return EngineArgs(**options).to_cli_args()


def profile_for_run(args, path: Path, serving_now: bool):
    """The profile rescaled to this machine's speed right before the run (kept at ``path``; a run
    not served again keeps the one measured before it), or as given with ``--no-rescale``."""
    if not args.rescale:
        return load_profile(args.profile)
    if path.exists() and not serving_now:
        return load_profile(path)
    cmd = [sys.executable, "-m", "jaxengine.lab", "calibrate", "--profile", args.profile, "--no-progress",
           "--result-file", str(path)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return load_profile(path)


def measure(options: dict, rate: float, args, path: Path) -> dict:
    if not path.exists() or args.remeasure:
        cmd = [sys.executable, "-m", "jaxengine.bench", "serve", "--launch", "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--token-ids", "100", "40000",
               "--ignore-eos", "--request-rate", str(rate), "--seed", str(args.seed), "--no-progress",
               "--result-file", str(path), "--trace-file", str(trace_path(path)), *flags(options)]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads(path.read_text())


def trace_path(measured_path: Path) -> Path:
    return measured_path.with_name(measured_path.name.replace("measured", "trace")).with_suffix(".jsonl")


def at_run_level(profile, options: dict, measured_path: Path):
    """``profile`` scaled to the steps the served run recorded (its first step compiles: skipped)."""
    from jaxengine.engine_args import EngineArgs

    points = trace_points(read_trace(trace_path(measured_path)), *EngineArgs(**options).step_buckets(), skip=1)
    return profile.scaled_to(*points, "run_level")


def predict(options: dict, rate: float, profile, args) -> tuple[dict, dict]:
    """The simulated run of the first seed (for the figures) and each statistic's median over
    ``args.sim_seeds`` seeds."""
    workload = Workload(num_requests=args.num_prompts, request_rate=rate, input_len=str(args.input_len),
                        output_len=str(args.output_len), seed=args.seed)
    runs = [simulate(workload, profile, seed=seed, **options).to_dict() for seed in range(args.sim_seeds)]
    return runs[0], {key: {stat: float(np.median([r[key][stat] for r in runs])) for stat in STATS} for key in KEYS}


def row(name: str, rate: float, measured: dict, predictions: dict[str, tuple]) -> dict:
    """Measured statistics and, per prediction, its speed factor and its errors (%)."""
    r = {"config": name, "rate": rate}
    for label, (profile, _, stats) in predictions.items():
        r[f"speed {label}"] = profile.source.get(label, {}).get("factor", 1.0)
    for key in KEYS:
        for stat in STATS:
            m = measured[key][stat]
            r[f"{key[:-3]} {stat} meas"] = m
            for label, (_, _, stats) in predictions.items():
                r[f"{key[:-3]} {stat} {label}"] = stats[key][stat]
                r[f"{key[:-3]} {stat} {label} err%"] = (stats[key][stat] - m) / m * 100
    return r


def plot(name: str, runs: list[tuple[float, dict, dict]], path: Path) -> Path:
    from jaxengine.bench.plots import latency_samples, new_figure, save_figure

    fig, axes = new_figure(rows=2)
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        for rate, measured, predicted in runs:
            for result, style, kind in ((measured, "-", "measured"), (predicted, "--", "simulated")):
                values = np.sort(latency_samples(result)[key])
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), style,
                        label=f"{rate:g} req/s {kind}")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if key == "ttft_ms" else "fraction of gaps")
        ax.legend(fontsize=7)
    axes[0].set_title(f"{name}: measured (solid) and simulated (dashed)")
    return save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--out", default="docs/bench/lab")
    p.add_argument("--rates", default="0.25,0.5")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))),
                   help="indices into CONFIGS")
    p.add_argument("--remeasure", action="store_true", help="serve again even where a measured result exists")
    p.add_argument("--rescale", action=argparse.BooleanOptionalAction, default=True,
                   help="rescale the profile to the machine's speed right before each served run")
    p.add_argument("--sim-seeds", type=int, default=5, help="simulations per point (noise draws)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    names = list(CONFIGS)
    for i in map(int, args.configs.split(",")):
        name, options = names[i], CONFIGS[names[i]]
        runs = []
        for rate in map(float, args.rates.split(",")):
            measured_path, profile_path = out / f"measured-{i}-{rate:g}.json", out / f"profile-{i}-{rate:g}.json"
            profile = profile_for_run(args, profile_path, serving_now=args.remeasure or not measured_path.exists())
            measured = measure(options, rate, args, measured_path)
            predictions = {}
            for label, p in (("rescaled", profile), ("run_level", at_run_level(profile, options, measured_path))):
                first, stats = predict(options, rate, p, args)
                write_result({**first, "over_seeds": stats}, out / f"simulated-{label}-{i}-{rate:g}.json")
                predictions[label] = (p, first, stats)
            runs.append((rate, measured, predictions["rescaled"][1]))
            rows.append(row(name, rate, measured, predictions))
        print("figure:", plot(name, runs, out / f"validation-{i}.png"))
    print_table(rows, title="simulated against measured (ms)")
    write_result({"profile": args.profile, "rows": rows}, out / "validation.json")


if __name__ == "__main__":
    main()
