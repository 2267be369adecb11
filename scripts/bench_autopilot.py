"""The autopilot against fixed settings on a workload that shifts phase, served for real.

    python scripts/bench_autopilot.py --out bench_results/autopilot [--phase-s 45]

Phases, back to back on one server: interactive chat at half its capacity, long-prompt
summarisation, a burst of chat at twice capacity, chat again. Capacities and the latency targets
come from a cost profile of this machine (calibrated first), so the same script means the same
thing on a faster machine. Four ways of serving it, in one run:

- the defaults;
- the best single fixed setting for the whole workload (the lab's ``tune`` on the profile);
- the per-phase oracle: each phase served by its own best fixed setting (its own server), which
  no fixed configuration can be;
- the autopilot (the defaults plus ``--slo-ttft-ms`` / ``--slo-itl-ms``, its profile the same).

Every request is a streamed completion of random token ids with ``ignore_eos`` (lengths known),
sent at its arrival time. Per phase: goodput (requests within both targets per second), TTFT
and ITL p99 (a request's ITL is its own p99 gap, as the lab reads it), 503s. The same table
from the simulator comes first (seconds to compute). Then the controller's host cost per step
at batch 64 against the decode step, and the budget's step-to-step changes in the autopilot
run's trace (and a plot of both runs' budgets).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxengine.bench.launch import launched_server
from jaxengine.bench.serve import RequestResult, request_body, stream_request
from jaxengine.engine_args import EngineArgs
from jaxengine.lab import Workload, load_profile, simulate, tune
from jaxengine.costmodel.step_shape import StepShape
from jaxengine.lab.workload import SimRequest
from jaxengine.trace import read_trace

SPACE = {"max_num_batched_tokens": [64, 128, 256, 512], "max_num_seqs": [8, 16, 32, 64],
         "long_prefill_token_threshold": [0, 64, 256], "max_num_partial_prefills": [1, 2, 4],
         "scheduler_delay_factor": [0.0, 0.5]}


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    load: float                # of the phase's own capacity
    input_len: str
    output_len: str


PHASES = (Phase("chat", 0.5, "lognormal:96", "lognormal:48"),
          Phase("summarise", 0.5, "900:1400", "24"),
          Phase("burst", 2.0, "lognormal:96", "lognormal:48"),
          Phase("chat again", 0.5, "lognormal:96", "lognormal:48"))


def calibrate(out: Path) -> Path:
    path = out / "profile.json"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "jaxengine.lab", "calibrate", "--contexts", "64,512",
                        "--rows", "1,8,32", "--decode-steps", "4", "--no-progress", "--result-file", str(path)],
                       check=True)
    return path


def targets(profile) -> dict[str, float]:
    """ITL: 2.5x a decode step of 16 rows at a 256-token context; TTFT: 3x a 1,400-token prompt
    at the whole budget (floored at 2 s)."""
    decode = profile.step_seconds(StepShape(16, 16, 256, 16 * 256, row_bucket=16), 16)
    prompt = math.ceil(1400 / 512) * profile.step_seconds(StepShape(512, 1, 512, 512, row_bucket=8,
                                                                    num_prefill_tokens=512), 512)
    return {"ttft_ms": round(max(2000.0, 3000 * prompt), -1), "itl_ms": round(2500 * decode, -1)}


def phase_rates(profile, slos, phase_s: float) -> list[float]:
    """Each phase's load x its capacity: the highest rate at which the defaults keep 95% of its
    requests within the targets (the simulator's search), or, where no rate does (long prompts
    beside decodes break the ITL target at any rate), the rate that keeps the machine busy."""
    from jaxengine.lab import capacity

    rates = []
    for p in PHASES:
        w = Workload(num_requests=max(40, int(phase_s)), input_len=p.input_len, output_len=p.output_len, seed=1)
        found = capacity(w, profile, slos, attainment=0.95).requests_per_s
        rates.append(p.load * (found if found > 0.05 else busy_rate(profile, w)))
    return rates


def busy_rate(profile, w: Workload) -> float:
    """Requests per second that keep the machine busy: prompts at the whole budget, outputs as
    decodes of 8 rows."""
    requests = w.requests(2048)
    prompt = np.mean([len(r.prompt_token_ids) for r in requests])
    output = np.mean([r.output_len for r in requests])
    prefill = profile.step_seconds(StepShape(512, 1, 512, 512, row_bucket=8, num_prefill_tokens=512), 512) / 512
    decode = profile.step_seconds(StepShape(8, 8, 256, 8 * 256, row_bucket=8), 8) / 8
    return float(1 / (prompt * prefill + output * decode))


def workload(rates: list[float], phase_s: float) -> list[tuple[int, SimRequest]]:
    """(phase index, request), arrival times continuing from phase to phase."""
    requests, start = [], 0.0
    for i, (p, rate) in enumerate(zip(PHASES, rates)):
        n = max(1, round(rate * phase_s))
        w = Workload(num_requests=n, request_rate=rate, input_len=p.input_len, output_len=p.output_len,
                     vocab_size=49152, seed=10 + i)
        requests += [(i, dataclasses.replace(r, arrival_s=start + r.arrival_s)) for r in w.requests(2048)]
        start += phase_s
    return requests


def per_phase(phases: list[int], records: list[dict], slos: dict, phase_s: float) -> list[dict]:
    """Each phase's goodput (within both targets per second of the phase), p99s and 503s."""
    rows = []
    for i, p in enumerate(PHASES):
        mine = [r for ph, r in zip(phases, records) if ph == i]
        ok = [r for r in mine if r["error"] is None]
        good = [r for r in ok if r["ttft_ms"] <= slos["ttft_ms"] and r["itl_p99_ms"] <= slos["itl_ms"]]
        rows.append({"phase": p.name, "requests": len(mine), "served": len(ok),
                     "rejected": sum(1 for r in mine if r["error"] and "503" in r["error"]),
                     "failed": sum(1 for r in mine if r["error"] and "503" not in r["error"]),
                     "goodput": len(good) / phase_s, "within_targets": len(good) / max(len(mine), 1),
                     "ttft_p99_ms": _p99([r["ttft_ms"] for r in ok]), "itl_p99_ms": _p99([r["itl_p99_ms"] for r in ok])})
    return rows


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def record(r: RequestResult) -> dict:
    gaps = [1e3 * g for g in r.itl_s]
    return {"error": r.error, "ttft_ms": None if r.ttft_s is None else 1e3 * r.ttft_s,
            "itl_p99_ms": float(np.percentile(gaps, 99)) if gaps else 0.0, "output_tokens": r.output_tokens}


# ---- simulated ----
def simulated(profile, requests, slos, options: dict, phase_s: float) -> list[dict]:
    result = simulate([r for _, r in requests], profile, slos=slos, seed=0, **options)
    records = [{"error": "HTTP 503" if m["error"] == "overloaded" else m["error"], "ttft_ms": m["ttft_ms"],
                "itl_p99_ms": float(np.percentile(m["itl_ms"], 99)) if m["itl_ms"] else 0.0}
               for m in result.metrics["requests"]]
    return per_phase([p for p, _ in requests], records, slos, phase_s)


# ---- served ----
async def send_all(url: str, model: str, requests: list[SimRequest]) -> list[RequestResult]:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30),
                                 limits=httpx.Limits(max_connections=10_000, keepalive_expiry=1.0)) as client:
        begin = time.perf_counter()

        async def one(r: SimRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - begin)))
            body = request_body("completions", model, list(r.prompt_token_ids), r.output_len,
                                {"ignore_eos": True, "temperature": 0})
            return await stream_request(client, url + "/completions", body, begin)

        return await asyncio.gather(*(one(r) for r in requests))


def served(options: dict, requests: list[SimRequest], trace_file: Path | None = None) -> list[dict]:
    args = EngineArgs(**options, **({"trace_file": str(trace_file)} if trace_file else {}))
    with launched_server(args, start_timeout_s=900) as server:
        from jaxengine.bench.serve import discover_model

        model = discover_model(server.api_url)
        wait_until_compiled(server.api_url)
        results = asyncio.run(send_all(server.api_url, model, requests))
    return [record(r) for r in results]


def wait_until_compiled(api_url: str, timeout_s: float = 900) -> None:
    """Every configuration is measured with all its buckets compiled (no compiler on the cores)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while not httpx.get(api_url.removesuffix("/v1") + "/health").json()["all_buckets_compiled"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not finish compiling its buckets")
        time.sleep(1)


# ---- the controller's cost ----
def host_cost(profile) -> dict:
    """plan + observe per step with 64 decoding requests and 64 waiting, against the profile's
    decode step at batch 64 (256-token contexts)."""
    from jaxengine.autopilot import attach_autopilot
    from jaxengine.engine import Engine
    from jaxengine.testing.fake_runner import ConstantRunner
    from jaxengine.sampling_params import SamplingParams

    args = EngineArgs(slo_ttft_ms=3000, slo_itl_ms=200)
    engine = Engine(args.engine_config(4096, 0, 2048), ConstantRunner())
    autopilot = attach_autopilot(engine, profile)
    for i in range(128):
        engine.add_request(str(i), list(range(1, 257)), SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(80):
        engine.step()
    out = engine.last_output
    n, start = 2000, time.perf_counter()
    for _ in range(n):
        plan = autopilot.plan(engine.scheduler, None)
        autopilot.observe(out, 0.1, [])
    per_step = (time.perf_counter() - start) / n
    decode = profile.step_seconds(StepShape(64, 64, 300, 64 * 300, row_bucket=64), 64)
    return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
            "budget": plan.limits.max_num_batched_tokens, "host_us_per_step": 1e6 * per_step,
            "decode_step_ms_batch_64": 1e3 * decode, "share_of_decode_step": per_step / decode}


def stability(trace_file: Path) -> dict:
    budgets = [t.autopilot_budget for t in read_trace(trace_file) if t.autopilot_budget]
    changes = [abs(b - a) for a, b in zip(budgets, budgets[1:])]
    return {"steps": len(budgets), "steps_changed": sum(1 for c in changes if c),
            "mean_abs_change": float(np.mean(changes)) if changes else 0.0,
            "reversals": sum(1 for a, b, c in zip(budgets, budgets[1:], budgets[2:]) if (b - a) * (c - b) < 0)}


def plot(out: Path, default_trace: Path, autopilot_trace: Path) -> None:
    from jaxengine.bench.plots import new_figure, save_figure

    fig, (ax,) = new_figure()
    for path, label in ((default_trace, "defaults: tokens per step"), (autopilot_trace, "autopilot: its budget")):
        traces = read_trace(path)
        values = [t.num_decode_tokens + t.num_prefill_tokens for t in traces] if "defaults" in label else \
            [t.autopilot_budget for t in traces]
        ax.plot([t.time for t in traces], values, lw=0.8, label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    save_figure(fig, out / "autopilot_budget.png")


def plot_phases(out: Path, report: dict) -> None:
    """Per phase and way of serving (served): goodput, TTFT p99 and ITL p99, the targets dashed."""
    from jaxengine.bench.plots import new_figure, save_figure

    served = report.get("served") or {}
    if not served:
        return
    fig, axes = new_figure(rows=3, height=2.4)
    names, width = list(served), 0.8 / max(len(served), 1)
    for k, (key, label, target) in enumerate((("goodput", "goodput (req/s)", None),
                                              ("ttft_p99_ms", "TTFT p99 (ms)", report["targets"]["ttft_ms"]),
                                              ("itl_p99_ms", "ITL p99 (ms)", report["targets"]["itl_ms"]))):
        ax = axes[k]
        for j, name in enumerate(names):
            values = [row[key] or 0 for row in served[name]]
            ax.bar([i + j * width for i in range(len(values))], values, width, label=name)
        if target:
            ax.axhline(target, ls="--", color="0.3", lw=0.8)
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(PHASES))], [p.name for p in PHASES])
    axes[0].legend(fontsize=7, ncol=len(names))
    save_figure(fig, out / "autopilot_phases.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results/autopilot"))
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--serve", default="defaults,best fixed,autopilot,per-phase oracle",
                        help="the ways to serve for real, comma-separated (the others are simulated only)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = calibrate(args.out)
    profile = load_profile(profile_path)
    slos = targets(profile)
    rates = phase_rates(profile, slos, args.phase_s)
    requests = workload(rates, args.phase_s)
    phases = [p for p, _ in requests]
    print("targets", slos, "rates", [round(r, 3) for r in rates], "requests", len(requests), flush=True)
    whole = tune([r for _, r in requests], profile, slos, space=SPACE, progress=False)
    oracle = [tune([r for p, r in requests if p == i], profile, slos, space=SPACE, progress=False).best.options
              for i in range(len(PHASES))]
    autopilot = {"slo_ttft_ms": slos["ttft_ms"], "slo_itl_ms": slos["itl_ms"], "cost_profile": str(profile_path)}
    configs = {"defaults": {}, "best fixed": whole.best.options, "autopilot": autopilot}
    report = {"targets": slos, "rates": rates, "phase_s": args.phase_s, "best_fixed": whole.best.options,
              "oracle": oracle, "simulated": {}, "served": {}, "host_cost": host_cost(profile)}
    for name, options in configs.items():
        report["simulated"][name] = simulated(profile, requests, slos, options, args.phase_s)
    report["simulated"]["per-phase oracle"] = [
        simulated(profile, [(0, r) for p, r in _shifted(requests, i, args.phase_s)], slos, oracle[i], args.phase_s)[0]
        | {"phase": PHASES[i].name} for i in range(len(PHASES))]
    _write(args.out, report)
    if not args.simulate_only:
        chosen = args.serve.split(",")
        for name, options in configs.items():
            if name not in chosen:
                continue
            trace = args.out / f"trace-{name.replace(' ', '-')}.jsonl"
            trace.unlink(missing_ok=True)
            records = served(options, [r for _, r in requests], trace)
            report["served"][name] = per_phase(phases, records, slos, args.phase_s)
            _write(args.out, report)
        report["served"]["per-phase oracle"] = []
        for i in range(len(PHASES) if "per-phase oracle" in chosen else 0):
            mine = [r for _, r in _shifted(requests, i, args.phase_s)]
            records = served(oracle[i], mine)
            report["served"]["per-phase oracle"].append(per_phase([0] * len(mine), records, slos, args.phase_s)[0]
                                                        | {"phase": PHASES[i].name})
            _write(args.out, report)
        if {"defaults", "autopilot"} <= set(chosen):
            report["stability"] = stability(args.out / "trace-autopilot.jsonl")
            plot(args.out, args.out / "trace-defaults.jsonl", args.out / "trace-autopilot.jsonl")
        plot_phases(args.out, report)
    _write(args.out, report)


def _shifted(requests, i: int, phase_s: float):
    return [(p, dataclasses.replace(r, arrival_s=r.arrival_s - i * phase_s)) for p, r in requests if p == i]


def _write(out: Path, report: dict) -> None:
    (out / "result.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    for kind in ("simulated", "served"):
        for name, rows in report.get(kind, {}).items():
            cells = " | ".join(f"{r['phase']}: {r['goodput']:.2f}/s {r['within_targets']:.0%} "
                               f"ttft99 {_ms(r['ttft_p99_ms'])} itl99 {_ms(r['itl_p99_ms'])} 503 {r['rejected']}"
                               for r in rows)
            print(f"{kind:9s} {name:16s} {cells}", flush=True)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    main()
