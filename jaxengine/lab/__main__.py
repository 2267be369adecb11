"""python -m jaxengine.lab COMMAND [options]: the scheduler lab.

    calibrate   measure this machine's step times (model options as in serve) -> a cost profile;
                with --profile, restate a profile at this machine's speed now
    simulate    a workload through the real scheduler on a profile's clock -> the bench figures
    tune        the engine options with the most goodput under SLOs -> the serve flags to use
    whatif      the request rate a machine sustains within SLOs (with --hardware: a roofline
                model of a machine that is not here, not a measurement)

Every command prints a table and writes its result as JSON (``--result-file``, default
``lab_results/<command>-<date>-<time>.json``; calibrate writes the profile there).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from jaxengine.bench.report import print_table, result_path, write_result
from jaxengine.bench.serve import parse_slo
from jaxengine.engine_args import EngineArgs, HelpFormatter, comma_separated
from jaxengine.logs import add_log_level_arg, configure_logging

RESULTS_DIR = "lab_results"
SCHEDULING_OPTIONS = ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_kv_blocks", "watermark",
                      "enable_prefix_caching", "enable_chunked_prefill", "long_prefill_token_threshold",
                      "max_num_partial_prefills", "preemption_mode", "scheduling_policy", "scheduler_delay_factor",
                      "max_model_len", "token_buckets", "request_buckets", "speculative_config")


class Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The docstring as written and each flag's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxengine.lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add in (("calibrate", _calibrate_args), ("simulate", _simulate_args), ("tune", _tune_args),
                      ("whatif", _whatif_args)):
        sub = commands.add_parser(name, help=COMMAND_HELP[name], description=COMMAND_HELP[name],
                                  formatter_class=Formatter)
        sub.add_argument("--result-file", help=f"the JSON result (default: {RESULTS_DIR}/<command>-<date>-<time>.json)")
        sub.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
        add_log_level_arg(sub, default="warning")
        add(sub)
    return parser


COMMAND_HELP = {
    "calibrate": "measure step latency over a grid of step shapes on this machine and fit a cost profile",
    "simulate": "replay a workload through the real scheduler with step times from a profile",
    "tune": "search the scheduling options for the most goodput under SLOs",
    "whatif": "the highest request rate within SLOs, on a measured profile or a roofline model",
}


# ---- arguments ----
def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=comma_separated(int), help="context lengths measured (default: 32,256,1024; "
                   "with --profile alone: 256)")
    p.add_argument("--rows", type=comma_separated(int), help="decode rows measured (default: 1,4,16,48; with "
                   "--profile alone: 1,4,16)")
    p.add_argument("--decode-steps", type=int, help="plain decode steps per (context, rows) (default: 4; with "
                   "--profile alone: 8)")
    p.add_argument("--repeats", type=int, help="passes over the grid (default: 1)")
    p.add_argument("--from-trace", metavar="TRACE", help="fit to a recorded step trace (--trace-file of serve) "
                   "instead of measuring; give the engine's --max-num-batched-tokens and --num-kv-blocks")
    p.add_argument("--profile", help="scale this measured profile instead of fitting a new one: alone, to this "
                   "machine's speed now (a small grid measured, a minute; engine options default to the profile's); "
                   "with --from-trace, to the trace's steps (the grid's shape, the trace's level and spread)")
    EngineArgs.add_cli_args(p)


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--requests", metavar="FILE", help="replay a recorded run: a bench serve result (.json) or a "
                   "JSONL request trace; the options below are then ignored")
    g.add_argument("--num-requests", type=int, default=200)
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    g.add_argument("--input-len", default="128", help="prompt tokens: N, LOW:HIGH or lognormal:MEAN[:SIGMA]")
    g.add_argument("--output-len", default="128", help="output tokens, as --input-len")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    g.add_argument("--num-adapters", type=int, default=0,
                   help="LoRA adapters the requests are spread over, uniformly (needs --enable-lora; 0: none)")
    g.add_argument("--priorities", type=_priorities, default=None, metavar="P:W,...",
                   help="priority mix, e.g. 0:0.8,1:0.2 (priority: weight)")
    g.add_argument("--n", type=int, default=1, help="samples per request")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", type=parse_slo, action="append", default=[], metavar="KEY=MS",
                   help="SLO, repeatable: ttft_ms, tpot_ms, itl_ms (a request's p99 gap), e2e_ms")
    p.add_argument("--noise", action=argparse.BooleanOptionalAction, default=True,
                   help="draw step times from the profile's measured spread")


def _profile_arg(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--profile", required=required, help="a cost profile JSON (from calibrate)")


def _acceptance_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--acceptance", type=float, help="speculative decoding: each draft token's probability of "
                   "acceptance on this workload (with --speculative-config; tune: it then decides k or off)")
    g.add_argument("--acceptance-from-trace", metavar="TRACE", help="... fitted to a step trace of a speculating "
                   "engine (serve --trace-file)")


def _acceptance(args: argparse.Namespace) -> float | None:
    if args.acceptance_from_trace:
        from jaxengine.lab.simulate import fit_acceptance
        from jaxengine.trace import read_trace

        return fit_acceptance(read_trace(args.acceptance_from_trace))
    return args.acceptance


def _simulate_args(p: argparse.ArgumentParser) -> None:
    _profile_arg(p)
    _workload_args(p)
    _acceptance_args(p)
    p.add_argument("--plot", metavar="DIR", help="draw the bench tool's figures into DIR")
    _engine_args(p)


def _tune_args(p: argparse.ArgumentParser) -> None:
    _profile_arg(p)
    _workload_args(p)
    _acceptance_args(p)
    p.add_argument("--max-rounds", type=int, default=4, help="passes over the options")
    p.add_argument("--plot", metavar="DIR", help="draw the trials' frontier into DIR")
    _engine_args(p)


def _whatif_args(p: argparse.ArgumentParser) -> None:
    from jaxengine.costmodel.roofline import HARDWARE, MODELS

    _profile_arg(p, required=False)
    p.add_argument("--hardware", choices=sorted(HARDWARE), help="a roofline model of this accelerator")
    p.add_argument("--model-shape", choices=sorted(MODELS), default="llama-3-8b", help="the model, with --hardware")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet every SLO")
    _workload_args(p)
    _engine_args(p)


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The scheduling options (the serve flags of the same names); others do not change a simulation."""
    EngineArgs.add_cli_args(p, skip=tuple(f for f in EngineArgs.__dataclass_fields__ if f not in SCHEDULING_OPTIONS))


def _priorities(text: str) -> dict[int, float]:
    try:
        return {int(p): float(w) for p, w in (part.split(":") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PRIORITY:WEIGHT,..., got {text!r}") from None


# ---- commands ----
def _workload(args: argparse.Namespace):
    from jaxengine.lab.workload import Workload, from_bench_result, from_jsonl

    if args.requests:
        return (from_jsonl if args.requests.endswith(".jsonl") else from_bench_result)(args.requests)
    return Workload(num_requests=args.num_requests, request_rate=args.request_rate, burstiness=args.burstiness,
                    input_len=args.input_len, output_len=args.output_len, shared_prefix_len=args.shared_prefix_len,
                    num_prefixes=args.num_prefixes, priorities=args.priorities, n=args.n,
                    num_adapters=args.num_adapters, seed=args.seed)


def _options(args: argparse.Namespace) -> dict:
    """The scheduling options given that differ from the defaults."""
    fields = EngineArgs.__dataclass_fields__
    return {k: getattr(args, k) for k in SCHEDULING_OPTIONS if getattr(args, k) != fields[k].default}


def run_calibrate(args: argparse.Namespace) -> dict:
    from jaxengine.lab.calibrate import SPEED_CHECK_GRID, CalibrationGrid, calibrate, rescale
    from jaxengine.costmodel.profile import CostProfile, load_profile, machine_description
    from jaxengine.trace import read_trace

    engine_args = EngineArgs.from_cli_args(args)
    if args.from_trace and args.profile:
        buckets, rows = engine_args.step_buckets()
        profile = load_profile(args.profile).adjusted_to_trace(read_trace(args.from_trace), buckets, rows)
        profile.source["adjusted_to_trace"]["trace"] = args.from_trace
    elif args.from_trace:
        if not engine_args.num_kv_blocks:
            raise ValueError("--from-trace: give --num-kv-blocks, the KV pool of the engine that recorded it")
        buckets, rows = engine_args.step_buckets()
        profile = CostProfile.from_trace(read_trace(args.from_trace), buckets, rows, num_gpu_blocks=engine_args.num_kv_blocks,
                                         block_size=engine_args.block_size,
                                         source={**machine_description(), "trace": args.from_trace})
    else:
        options = {k: v for k, v in dataclasses.asdict(engine_args).items()
                   if k != "model" and v != EngineArgs.__dataclass_fields__[k].default}
        if args.profile:
            base = load_profile(args.profile)
            if not isinstance(base, CostProfile):
                raise ValueError("--profile: a measured profile (a roofline model has no machine to measure)")
            profile = rescale(base, engine_args.model, grid=_grid(args, SPEED_CHECK_GRID), progress=args.progress,
                              **options)
            profile.source["rescaled"]["profile"] = args.profile
            print(f"rescaled by {profile.source['rescaled']['factor']:.3f} (measured / predicted, median)")
        else:
            profile = calibrate(engine_args.model, grid=_grid(args, CalibrationGrid()), progress=args.progress,
                                **options)
    e = profile.fit_error
    print_table([{"steps": e.num_steps, "mean_err_%": e.mean_abs_pct, "p50_err_%": e.p50_abs_pct,
                  "p90_err_%": e.p90_abs_pct, "max_err_%": e.max_abs_pct}], title="profile fit")
    return {"command": "calibrate", **profile.to_dict()}


def _grid(args: argparse.Namespace, default):
    """The calibration grid: ``default`` with the grid flags given."""
    given = {"contexts": args.contexts and tuple(args.contexts), "rows": args.rows and tuple(args.rows),
             "decode_steps": args.decode_steps, "repeats": args.repeats}
    return dataclasses.replace(default, **{k: v for k, v in given.items() if v is not None})


def run_simulate(args: argparse.Namespace) -> dict:
    from jaxengine.costmodel.profile import load_profile
    from jaxengine.lab.simulate import simulate

    result = simulate(_workload(args), load_profile(args.profile), slos=dict(args.slo), noise=args.noise,
                      seed=args.seed, acceptance=_acceptance(args) or 0.0, **_options(args))
    print_table([result.summary()], title=f"simulated in {result.wall_s:.2f} s ({result.num_steps} steps)")
    if args.plot:
        for path in result.plot(args.plot):
            print(f"figure: {path}")
    return {"command": "simulate", **result.to_dict()}


def run_tune(args: argparse.Namespace) -> dict:
    from jaxengine.costmodel.profile import load_profile
    from jaxengine.lab.tune import tune

    if not args.slo:
        raise ValueError("tune: give at least one --slo, e.g. --slo ttft_ms=2000 --slo itl_ms=100")
    result = tune(_workload(args), load_profile(args.profile), dict(args.slo), base_options=_options(args),
                  max_rounds=args.max_rounds, noise=args.noise, seed=args.seed, progress=args.progress,
                  acceptance=_acceptance(args))
    print_table(result.table()[:10], title=f"best of {len(result.trials)} trials (simulated goodput, req/s)")
    print(f"defaults: goodput {result.default.goodput:.3f} req/s; tuned: {result.best.goodput:.3f} req/s")
    print(f"recommended: {result.command}")
    if args.plot:
        print(f"figure: {result.plot_frontier(f'{args.plot}/tune_frontier.png')}")
    return {"command": "tune", "slo": result.slos, "recommended_flags": result.flags, "best": vars(result.best),
            "default": vars(result.default), "trials": [vars(t) for t in result.trials]}


def run_whatif(args: argparse.Namespace) -> dict:
    from jaxengine.lab.capacity import capacity
    from jaxengine.costmodel.profile import load_profile
    from jaxengine.costmodel.roofline import roofline_profile

    if not args.slo:
        raise ValueError("whatif: give at least one --slo")
    if bool(args.hardware) == bool(args.profile):
        raise ValueError("whatif: give either --hardware (a roofline model) or --profile (a measured one)")
    profile = roofline_profile(args.hardware, args.model_shape) if args.hardware else load_profile(args.profile)
    workload = _workload(args)
    if isinstance(workload, list):
        raise ValueError("whatif: searches the request rate, so it takes a workload recipe, not --requests")
    found = capacity(workload, profile, dict(args.slo), attainment=args.attainment, **_options(args))
    print_table([{"req_per_s": found.requests_per_s, "attainment": found.attainment,
                  **{k: v for k, v in found.summary.items() if k.endswith("_ms")}}],
                title=f"capacity within {dict(args.slo)} ({found.note})")
    return {"command": "whatif", "profile": profile.to_dict(), **found.to_dict()}


COMMANDS = {"calibrate": run_calibrate, "simulate": run_simulate, "tune": run_tune, "whatif": run_whatif}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    try:
        result = COMMANDS[args.command](args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    path = write_result(result, result_path(args.command, args.result_file, RESULTS_DIR))
    print(f"result: {path}", flush=True)
    return result


if __name__ == "__main__":
    main()
