"""The package's folders are its layers, and imports run one way between them: doors -> cost
model and autopilot -> engine -> runner -> core -> speculative decoding -> models/sample ->
kernels -> types, never up and never in a circle (between modules, or between folders), and the
host-side floors (core, types) never import JAX. Every folder and top-level module of the package
is listed in exactly one layer. Read from the source with ``ast``: imports inside functions and
under ``TYPE_CHECKING`` count too (a lazy import hides a circle, it does not remove it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "jaxengine"

# Lowest first: each layer's units, the package's folders and top-level modules ("" is the
# package's own __init__). A module may import from its own layer or any layer below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("config", "sampling_params", "request", "lora_request", "outputs", "trace", "paths", "logs",
               "generation_config", "buckets")),
    ("kernels", ("kernels",)),
    ("models", ("models", "sample")),
    ("spec_decode", ("spec_decode",)),
    ("core", ("core",)),
    ("runner", ("runner", "testing")),
    ("engine", ("engine", "engine_args", "output_processor", "parallel", "default_model", "tokenizer")),
    ("cost model", ("costmodel", "autopilot")),
    ("doors", ("", "host", "llm", "serve", "generate", "bench", "lab", "demo", "multihost_worker")),
]
NO_JAX = ("types", "core")                 # host-side floors: plain Python (and numpy)
JAX_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax")


def package_modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT / PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found[".".join((PACKAGE, *parts))] = path
    return found


def unit_of(module: str) -> str:
    """The folder or top-level module of the package that ``module`` is or lies in ("": the
    package's __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_names(module: str, path: Path) -> list[str]:
    """Every absolute module name ``module`` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_package else parts[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names += [f"{base}.{a.name}" for a in node.names] + [base]
    return names


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The package module ``name`` is (or lies in), None for a third-party one."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    known = package_modules()
    graph = {}
    for module, path in known.items():
        targets = {resolve(n, known) for n in imported_names(module, path)}
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def layer_of(module: str) -> int:
    ranks = [i for i, (_, units) in enumerate(LAYERS) if unit_of(module) in units]
    assert ranks, f"{unit_of(module)!r} ({module}) is in no layer: add it to LAYERS"
    return ranks[0]


def unit_graph() -> dict[str, set[str]]:
    """Imports between the package's folders and top-level modules."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_folder_and_module_is_in_exactly_one_layer():
    listed = [unit for _, units in LAYERS for unit in units]
    assert len(listed) == len(set(listed))
    assert sorted({unit_of(m) for m in package_modules()}) == sorted(listed)


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_the_folders_have_no_import_circle():
    assert circles(unit_graph()) == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(import_graph().items()) for t in sorted(targets)
              if layer_of(t) > layer_of(m)]
    assert upward == []


def test_the_host_side_floors_never_import_jax():
    known = package_modules()
    found = [f"{m} imports {n}" for m, path in sorted(known.items()) if LAYERS[layer_of(m)][0] in NO_JAX
             for n in imported_names(m, path) if n.split(".")[0] in JAX_PACKAGES]
    assert found == []


def test_the_checks_see_lazy_imports_and_catch_a_circle_and_an_upward_import():
    """The checks themselves: a function-level import counts, a circle is found, a layer is ranked."""
    source = ROOT / "jaxengine" / "request.py"
    assert "jaxengine.sampling_params" in {resolve(n, package_modules()) for n in imported_names(
        "jaxengine.request", source)}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("jaxengine.core.scheduler") < layer_of("jaxengine.runner.model_runner") < layer_of("jaxengine.llm")
    assert layer_of("jaxengine.paths") < layer_of("jaxengine.kernels.paged_attention") < layer_of(
        "jaxengine.models.llama") == layer_of("jaxengine.models.config")
    assert unit_of("jaxengine") == "" and unit_of("jaxengine.core.scheduler") == "core"


@pytest.mark.parametrize("code, expected", [
    ("def f():\n    from jaxengine.core.scheduler import Scheduler\n", "jaxengine.core.scheduler"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import Engine\n", "jaxengine.engine"),
])
def test_lazy_and_type_checking_imports_are_read(tmp_path, code, expected):
    path = tmp_path / "probe.py"
    path.write_text(code)
    names = {resolve(n, package_modules()) for n in imported_names("jaxengine.core.probe", path)}
    assert expected in names
