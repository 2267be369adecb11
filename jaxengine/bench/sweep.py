"""Sweep: a grid over one or two options of the throughput (or serve) mode.

``--grid max_num_batched_tokens=256,512 --grid scheduler_delay_factor=0,1`` runs the four
combinations; a grid name is any option of the target mode (an engine option, a workload
option), written as its flag without dashes or with underscores, each value as on the command
line. Options joined by ``+`` move together, one value each per point:
``--grid enable_chunked_prefill+max_num_batched_tokens=true+256,false+1024`` is one axis of two
points (chunked prefill in a small budget against whole prefills in a large one). The result holds one result per point (``"points"``: its ``params`` and the target's
``result``) and ``"frontier"``: the indices of the points on the throughput-latency frontier
(no other point has both more output tokens/s and a lower median request latency).
"""
from __future__ import annotations

import argparse
import copy
import gc
import itertools

from tqdm.auto import tqdm

from jaxengine.bench.report import print_table

MAX_AXES = 2


def add_arguments(parser, targets: dict) -> None:
    """``targets``: mode name -> its module (``add_arguments``, ``run``); the first is the default.
    Their parsers are made like ``parser`` (its class and formatter)."""
    parser.add_argument("--grid", action="append", type=parse_axis, required=True, metavar="NAME=V1,V2,...",
                        help=f"an option of the target and its values; up to {MAX_AXES} (their product is run)")
    sub = parser.add_subparsers(dest="target", metavar="{" + ",".join(targets) + "}",
                                help=f"the mode each point runs (default: {next(iter(targets))}), then its options")
    for name, module in targets.items():
        doc = module.__doc__ or name
        target = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                                formatter_class=parser.formatter_class)
        module.add_arguments(target)
        target.set_defaults(target_run=module.run, target_parser=target)


def parse_axis(text: str) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``a+b=1+2,3+4`` -> (("a", "b"), [("1", "2"), ("3", "4")])."""
    name, sep, values = text.partition("=")
    names = tuple(n.strip().lstrip("-").replace("-", "_") for n in name.split("+"))
    points = [tuple(v.strip() for v in value.split("+")) for value in values.split(",") if value.strip()]
    if not sep or not all(names) or not points:
        raise argparse.ArgumentTypeError(f"expected NAME=V1,V2,... or NAME+NAME=V+W,..., got {text!r}")
    if any(len(p) != len(names) for p in points):
        raise argparse.ArgumentTypeError(f"{text!r}: every value needs one part per name ({len(names)})")
    return names, points


def run(args) -> dict:
    names = [n for axis_names, _ in args.grid for n in axis_names]
    if len(set(names)) != len(names) or len(args.grid) > MAX_AXES:
        raise ValueError(f"--grid: one to {MAX_AXES} axes of different options, got {names}")
    axes = [[{n: option_value(args.target_parser, n, v) for n, v in zip(axis_names, point)} for point in points]
            for axis_names, points in args.grid]
    points = [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*axes)]
    runs = []
    for point in tqdm(points, desc="sweep", unit="point", disable=not args.progress):
        point_args = copy.copy(args)
        for name, value in point.items():
            setattr(point_args, name, value)
        result = args.target_run(point_args)
        gc.collect()            # the point's engine and its device memory go before the next one's
        runs.append({"params": {name: _plain(value) for name, value in point.items()}, "result": result})
    frontier = frontier_indices([_throughput_and_latency(r["result"]) for r in runs])
    print_table([table_row(r, i in frontier) for i, r in enumerate(runs)], title=f"sweep of {args.target}")
    grid = {"+".join(axis[0]): [_axis_value(tuple(point.values())) for point in axis] for axis in axes}
    return {"mode": "sweep", "target": args.target, "grid": grid, "points": runs, "frontier": frontier}


def option_value(parser: argparse.ArgumentParser, name: str, text: str):
    """``text`` converted as the target's flag for ``name`` converts it."""
    actions = [a for a in parser._actions if a.dest == name and a.option_strings]
    if not actions:
        raise ValueError(f"--grid: {name!r} is not an option of this mode (see its --help)")
    action = actions[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        if text.lower() not in BOOLEANS:
            raise ValueError(f"--grid {name}: expected one of {sorted(BOOLEANS)}, got {text!r}")
        return BOOLEANS[text.lower()]
    try:
        value = action.type(text) if action.type is not None else text
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"--grid {name}: {text!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"--grid {name}: {value!r} not among {list(action.choices)}")
    return value


BOOLEANS = {"true": True, "1": True, "on": True, "yes": True, "false": False, "0": False, "off": False, "no": False}


def _axis_value(values: tuple):
    return _plain(values[0]) if len(values) == 1 else "+".join(str(_plain(v)) for v in values)


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _throughput_and_latency(result: dict) -> tuple[float, float] | None:
    """(output tok/s, median e2e latency ms) of an offline ``throughput`` result (under
    ``metrics``) or a ``serve`` result (top level, ``output_throughput`` and ``e2e_ms``)."""
    metrics = result.get("metrics", {})
    if "output_tokens_per_s" in metrics and "p50" in metrics.get("e2e_latency_ms", {}):
        return metrics["output_tokens_per_s"], metrics["e2e_latency_ms"]["p50"]
    if result.get("output_throughput") is not None and (result.get("e2e_ms") or {}).get("median") is not None:
        return result["output_throughput"], result["e2e_ms"]["median"]
    return None


def frontier_indices(points: list[tuple[float, float] | None]) -> list[int]:
    """Indices of the (throughput, latency) points no other point beats on both (more
    throughput and less latency, one of them strictly); None entries are left out."""
    def beaten(p, q) -> bool:
        return q[0] >= p[0] and q[1] <= p[1] and q != p

    return [i for i, p in enumerate(points)
            if p is not None and not any(q is not None and beaten(p, q) for q in points)]


def table_row(run: dict, on_frontier: bool) -> dict:
    result = run["result"]
    metrics = result.get("metrics", {})
    throughput_latency = _throughput_and_latency(result) or (None, None)
    return {**run["params"], "req/s": metrics.get("requests_per_s", result.get("request_throughput")),
            "output tok/s": throughput_latency[0], "p50 latency ms": throughput_latency[1],
            "frontier": on_frontier}
