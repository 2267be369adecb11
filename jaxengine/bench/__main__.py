"""python -m jaxengine.bench MODE [options]: one command for the engine's benchmarks.

    throughput  offline: N requests through LLM.generate (optionally against baselines)
    serve       a client against a running OpenAI-compatible server
    latency     the compiled step's time per (token bucket, row bucket)
    sweep       a grid over one or two options of throughput (or serve)

Every mode prints a table, writes its result as JSON (``--result-file``, default
``bench_results/<mode>-<date>-<time>.json``) and with ``--plot DIR`` draws its figures there.
"""
from __future__ import annotations

import argparse
import sys

from jaxengine.bench import latency, serve, sweep, throughput
from jaxengine.bench.report import RESULTS_DIR, result_path, write_result
from jaxengine.engine_args import HelpFormatter as DefaultsFormatter
from jaxengine.logs import add_log_level_arg, configure_logging

MODES = {"throughput": throughput, "serve": serve, "latency": latency, "sweep": sweep}
SWEEP_TARGETS = {"throughput": throughput, "serve": serve}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """A mode's docstring as written, and each flag's default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxengine.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, module in MODES.items():
        doc = module.__doc__ or name
        sub = modes.add_parser(name, help=doc.splitlines()[0], description=doc, formatter_class=HelpFormatter,
                               conflict_handler="resolve")    # a mode may define a common flag itself
        add_output_arguments(sub)
        if module is sweep:
            sweep.add_arguments(sub, SWEEP_TARGETS)
        else:
            module.add_arguments(sub)
    return parser


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--result-file", help=f"the JSON result (default: {RESULTS_DIR}/<mode>-<date>-<time>.json)")
    group.add_argument("--results-dir", default=str(RESULTS_DIR), help="folder of the default result file")
    group.add_argument("--plot", metavar="DIR", help="draw the result's figures into DIR")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="progress bars on long runs")
    add_log_level_arg(group, default="warning")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode == "sweep" and args.target is None:          # the default target
        args = parser.parse_args([*argv, next(iter(SWEEP_TARGETS))])
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    result = MODES[args.mode].run(args)
    path = write_result(result, result_path(args.mode, args.result_file, args.results_dir))
    print(f"result: {path}", flush=True)
    if args.plot:
        from jaxengine.bench.plots import plot_result

        for figure in plot_result(result, args.plot):
            print(f"figure: {figure}", flush=True)
    return result


if __name__ == "__main__":
    main()
