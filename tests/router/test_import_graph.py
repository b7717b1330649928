"""The project's import graph, parsed from the source: no circles, and no arrow that points up.

``router`` (the service) sits on ``tiers`` (the engines) and ``classifier`` (the score); neither
of those may import ``router``, not even inside a function or for type checking only - an arrow
hidden in a function body is still an arrow. Circles are found among modules (Tarjan's strongly
connected components), counting every import: module level, function level and
``TYPE_CHECKING`` blocks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "tiers", "classifier")

# Circles outside this test's owner, known when the test was written; a new circle, or one of
# these growing, fails. Remove an entry when its circle is broken.
KNOWN_CIRCLES: list[frozenset[str]] = []

# (importer prefix, imported prefix) pairs that must never appear.
FORBIDDEN: list[tuple[str, str]] = [
    ("tiers", "router"),
    ("classifier", "router"),
]

# The service's own layers, top first: a module imports from its own layer or the ones below.
ROUTER_LAYERS: list[tuple[str, ...]] = [
    ("router.__main__", "router.cli"),
    ("router.http",),  # app, routes, middleware, auth, server, lifespan, reload, admin
    ("router.pipeline",),  # service, admission, cache, session, shadow, feedback, limits
    ("router.backends",),  # the tier set, local engine tiers
    ("router.openai",),  # wire types, output spec, tools, SSE and JSON writers
    ("router.policy",),  # schema, loader, decide, signals, thresholds
    ("router.errors", "router.telemetry"),
]
# The engine package's layers, top first (issue 53): kernels and layers below models, models below
# the worker, the worker below the engine; sampling and speculation between; the torch-free core
# (request state, KV blocks, scheduler) at the bottom.
TIERS_LAYERS: list[tuple[str, ...]] = [
    ("tiers.engine",),  # the step loop, intake, output post-processing, warm-up, forecasts
    ("tiers.spec_decode",),  # proposers, the controller and its cost model
    ("tiers.sample",),  # sampler, logits processors, grammar, the acceptance rule
    ("tiers.worker",),  # model runner, device worker
    ("tiers.models",),  # the fast Llama decoder, loading, memory planning
    ("tiers.attention", "tiers.layers"),  # attention backends; fused, packed and quantized linears
    ("tiers.kernels",),  # the compiled CPU kernels' loader
    ("tiers.core",),  # sequences, outputs, block manager, scheduler: no torch
]
LAYERS = {"router": ROUTER_LAYERS, "tiers": TIERS_LAYERS}
# Arrows up the layers that remain, each with its reason; a new one fails.
ALLOWED_UPWARD: set[str] = set()


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the packages."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: Mapping[str, Path]) -> str | None:
    """The project module that ``name`` (a module, or an attribute of one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """Project modules that ``module`` imports anywhere in its file (``ast.walk`` reaches imports
    in functions, classes and ``if TYPE_CHECKING:`` blocks alike); relative imports resolved."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        targets.update(t for n in names if (t := _owner(n, modules)) is not None)
    targets.discard(module)
    return targets


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden_arrows(graph: Mapping[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        for low, high in FORBIDDEN
        if _within(src, low) and _within(dst, high)
    )


def _layer(module: str) -> tuple[str, int] | None:
    """(package, index in its ``LAYERS`` list) of ``module``; None for a package's own
    ``__init__`` (it may re-export from any layer) and for packages without layers."""
    package = module.partition(".")[0]
    for i, prefixes in enumerate(LAYERS.get(package, ())):
        if any(_within(module, p) for p in prefixes):
            return package, i
    return None


def upward_arrows(graph: Mapping[str, set[str]]) -> list[str]:
    """Imports from a module to one in a higher layer of its package's ``LAYERS``."""
    found = []
    for src, dsts in graph.items():
        for dst in dsts:
            low, high = _layer(src), _layer(dst)
            if low is not None and high is not None and low[0] == high[0] and high[1] < low[1]:
                found.append(f"{src} -> {dst}")
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def test_no_new_import_circle(graph: dict[str, set[str]]) -> None:
    new = [sorted(c) for c in circles(graph) if not any(c <= known for known in KNOWN_CIRCLES)]
    assert not new, f"import circles: {new}"


def test_no_upward_arrow(graph: dict[str, set[str]]) -> None:
    assert forbidden_arrows(graph) == []
    assert [a for a in upward_arrows(graph) if a not in ALLOWED_UPWARD] == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_every_module_has_a_layer(graph: dict[str, set[str]], package: str) -> None:
    """A new sub-package or top-level module is placed in ``LAYERS``, so the rule above sees it."""
    assert [m for m in graph if _within(m, package) and m != package and _layer(m) is None] == []


def test_the_parser_sees_hidden_circles_and_upward_arrows(tmp_path: Path) -> None:
    """The checks above pass vacuously if the parser misses imports; here it must find a circle
    closed only by a function-level relative import and a type-only arrow from tiers to router."""
    (tmp_path / "router" / "policy").mkdir(parents=True)
    (tmp_path / "tiers").mkdir()
    for package in ("router", "router/policy", "tiers"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "router" / "a.py").write_text("from router.b import thing\n")
    (tmp_path / "router" / "b.py").write_text("def thing():\n    from . import a\n    return a\n")
    (tmp_path / "router" / "policy" / "schema.py").write_text("from ..a import thing\n")
    (tmp_path / "tiers" / "plan.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.policy.schema import Policy\n"
    )
    (tmp_path / "router" / "policy" / "decide.py").write_text("import router.http.app\n")
    (tmp_path / "router" / "http").mkdir()
    (tmp_path / "router" / "http" / "__init__.py").write_text("")
    (tmp_path / "router" / "http" / "app.py").write_text("from router.policy import decide\n")
    planted = import_graph(tmp_path, ("router", "tiers"))
    assert planted["router.policy.schema"] == {"router.a"}
    assert sorted(map(sorted, circles(planted))) == [
        ["router.a", "router.b"],
        ["router.http.app", "router.policy.decide"],
    ]
    assert forbidden_arrows(planted) == ["tiers.plan -> router.policy.schema"]
    assert upward_arrows(planted) == ["router.policy.decide -> router.http.app"]


def test_the_real_graph_is_parsed(graph: dict[str, set[str]]) -> None:
    """The real code's graph is whole (not empty by a path mistake): every package is in it and
    the service's arrows down to the engines and the classifier are seen."""
    assert {name.partition(".")[0] for name in graph} == set(PACKAGES) and len(graph) > 60
    arrows = {(src.partition(".")[0], dst.partition(".")[0]) for src, dsts in graph.items() for dst in dsts}
    assert {("router", "tiers"), ("router", "classifier"), ("router", "router")} <= arrows


def test_the_layer_rule_sees_an_upward_arrow_inside_tiers(tmp_path: Path) -> None:
    """Catches the tiers layers going unchecked: the torch-free core importing the engine, or a
    model importing the worker, is an upward arrow; the engine importing the core is not."""
    for package in ("tiers", "tiers/core", "tiers/engine", "tiers/models", "tiers/worker"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tiers" / "core" / "sequence.py").write_text("def f():\n    from tiers.engine import step\n")
    (tmp_path / "tiers" / "engine" / "step.py").write_text("from tiers.core.sequence import f\n")
    (tmp_path / "tiers" / "models" / "llama.py").write_text("from ..worker import runner\n")
    (tmp_path / "tiers" / "worker" / "runner.py").write_text("x = 1\n")
    planted = import_graph(tmp_path, ("tiers",))
    assert upward_arrows(planted) == [
        "tiers.core.sequence -> tiers.engine.step",
        "tiers.models.llama -> tiers.worker.runner",
    ]
