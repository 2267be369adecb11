"""The package's imports run one way: doors -> engine -> runner -> core -> models/sample ->
kernels -> types, never up and never in a circle, and the host-side floors (core, types)
never import JAX. Read from the source with ``ast``: imports inside functions and under
``TYPE_CHECKING`` count too (a lazy import hides a circle, it does not remove it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"jaxengine": "jaxengine"}

# Lowest first. A module may import from its own layer or any layer below; the most specific
# prefix decides a module's layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("jaxengine.config", "jaxengine.sampling_params", "jaxengine.request", "jaxengine.lora_request", "jaxengine.outputs",
               "jaxengine.trace", "jaxengine.models.config", "jaxengine.models.paths")),
    ("kernels", ("jaxengine.kernels",)),
    ("models", ("jaxengine.models", "jaxengine.sample")),
    ("core", ("jaxengine.core", "jaxengine.structured_output", "jaxengine.spec_decode")),
    ("runner", ("jaxengine.runner",)),
    ("engine", ("jaxengine.engine", "jaxengine.engine_args", "jaxengine.output_processor", "jaxengine.parallel",
                "jaxengine.default_model", "jaxengine.tokenizer")),
    ("doors", ("jaxengine", "jaxengine.llm", "jaxengine.serve", "jaxengine.generate", "jaxengine.bench",
               "jaxengine.lab", "jaxengine.demo", "jaxengine.logs", "jaxengine.multihost_worker")),
]
NO_JAX = ("types", "core")                 # host-side floors: plain Python (and numpy)
JAX_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax")


def package_modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


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
    best, rank = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


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


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


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
    assert layer_of("jaxengine.models.config") < layer_of("jaxengine.kernels.paged_attention") < layer_of(
        "jaxengine.models.llama")


@pytest.mark.parametrize("code, expected", [
    ("def f():\n    from jaxengine.core.scheduler import Scheduler\n", "jaxengine.core.scheduler"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import Engine\n", "jaxengine.engine"),
])
def test_lazy_and_type_checking_imports_are_read(tmp_path, code, expected):
    path = tmp_path / "probe.py"
    path.write_text(code)
    names = {resolve(n, package_modules()) for n in imported_names("jaxengine.core.probe", path)}
    assert expected in names
