"""The shape of ``tiers/`` (issue 34): no import circle, no file past its size, no reach into the
service's packages, and one writer of a sequence's computed counts.

Imports are read from the source (``ast``), every one of them: module level, inside functions, and
under ``TYPE_CHECKING`` (a circle there is still two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TIERS = Path(__file__).resolve().parents[2] / "tiers"
MAX_LINES = 450
MAX_ENGINE_LINES = 300
SERVICE_PACKAGES = ("router", "classifier")
SERVICE_IMPORTS_ALLOWED = {"plan"}
"""``tiers/plan.py`` still reads the policy's types (being moved out by its owner)."""
STATE_WRITERS = {"scheduler", "draft_tables"}
"""``Scheduler`` and its draft-table mixin: the only code that writes the counts below."""
STATE_FIELDS = ("num_computed_tokens", "num_draft_computed_tokens")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, by full dotted name (relative imports resolved)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([package, *([base] if base else [])])
            out.add(base)
            # ``from tiers import engine`` imports the module ``tiers.engine``.
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    package = root.name
    names = {p.stem for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        deps = set()
        for name in imported_modules(path, package):
            parts = name.split(".")
            if parts[0] == package and len(parts) > 1 and parts[1] in names:
                deps.add(parts[1])
        graph[path.stem] = deps - {path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_sees_circles_through_function_level_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    """The finder itself: a planted circle (a -> b at module level, b -> c inside a function,
    c -> a under TYPE_CHECKING) is found whole, and a chain without one is not."""
    pkg = tmp_path / "tiers"
    pkg.mkdir()
    (pkg / "a.py").write_text("from tiers.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from tiers import c\n    return c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tiers.a import thing\n"
    )
    (pkg / "d.py").write_text("import tiers.a\n")
    graph = import_graph(pkg)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_inside_tiers() -> None:
    """Catches modules that cannot be read apart: device <-> engine <-> request and
    fast_forward <-> model_runner were circles before issue 34."""
    graph = import_graph(TIERS)
    assert {"engine", "scheduler", "device", "proposers"} <= graph.keys()  # the real package was read
    assert "scheduler" in graph["engine"]
    assert cycles(graph) == []


@pytest.mark.parametrize("path", sorted(TIERS.glob("*.py")), ids=lambda p: p.name)
def test_no_file_in_tiers_is_over_its_size(path: Path) -> None:
    """Catches a module growing back into several jobs (engine.py held seven in 870 lines)."""
    lines = len(path.read_text().splitlines())
    limit = MAX_ENGINE_LINES if path.name == "engine.py" else MAX_LINES
    assert lines <= limit, f"{path.name} has {lines} lines (at most {limit})"


def test_tiers_imports_nothing_of_the_service_but_where_allowed() -> None:
    """Catches the engine package reaching into the HTTP service or the classifier (it must run
    and be tested without them); ``plan.py`` alone is still allowed its policy import."""
    offenders = {}
    for path in sorted(TIERS.glob("*.py")):
        if path.stem in SERVICE_IMPORTS_ALLOWED:
            continue
        bad = sorted(m for m in imported_modules(path, "tiers") if m.split(".")[0] in SERVICE_PACKAGES)
        if bad:
            offenders[path.name] = bad
    assert offenders == {}


def _writes(path: Path) -> list[tuple[int, str]]:
    """``(line, field)`` of every assignment to ``<x>.num_computed_tokens`` and the like."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and t.attr in STATE_FIELDS:
                    out.append((t.lineno, t.attr))
    return out


def test_only_the_scheduler_writes_a_sequences_computed_counts(tmp_path: Path) -> None:
    """Catches a second writer of ``num_computed_tokens`` / ``num_draft_computed_tokens`` (the
    engine and the scheduler both wrote them before issue 34). The scan itself is checked on a
    planted writer of each form (plain, augmented, tuple target)."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "seq.num_computed_tokens = 1\nseq.num_draft_computed_tokens += 2\na, seq.num_computed_tokens = 1, 2\n"
    )
    assert _writes(planted) == [
        (1, "num_computed_tokens"),
        (2, "num_draft_computed_tokens"),
        (3, "num_computed_tokens"),
    ]
    writers = {p.stem for p in TIERS.glob("*.py") if _writes(p)}
    assert "scheduler" in writers  # the scan reached the real writer
    assert writers <= STATE_WRITERS, f"also written in {sorted(writers - STATE_WRITERS)}"


def test_the_engine_never_asks_which_kind_of_draft_it_has() -> None:
    """Catches drafting logic branching on the draft's type in the engine (six
    ``isinstance(self.draft, NgramProposer)`` branches before issue 34): proposers hide it."""
    tree = ast.parse((TIERS / "engine.py").read_text())
    checks = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
    ]
    assert not [c for c in checks if "Ngram" in c or "ModelRunner" in c or "draft" in c], checks
