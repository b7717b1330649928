"""The shape of ``tiers/`` (issues 34 and 53): no import circle, no file past its size, no flat
package past its module count, no reach into the service's packages, and one writer of a
sequence's computed counts. The layer rule inside ``tiers/`` is ``tests/router/test_import_graph``'s.

Every ``.py`` under ``tiers/`` is read, sub-packages included (``rglob``), and imports are read from
the source (``ast``), every one of them: module level, inside functions, and under
``TYPE_CHECKING`` (a circle there is still two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.router.test_import_graph import circles, find_modules, import_graph, imports_of

ROOT = Path(__file__).resolve().parents[2]
TIERS = ROOT / "tiers"
MAX_LINES = 450
MAX_ENGINE_LINES = 300
MAX_MODULES = 12
"""Modules (``__init__`` aside) one package holds directly before it is split into rooms."""
SERVICE_PACKAGES = ("router", "classifier")
STATE_WRITERS = {"tiers.core.sched.scheduler", "tiers.core.sched.draft_tables"}
"""``Scheduler`` and its draft-table mixin: the only code that writes the counts below."""
STATE_FIELDS = ("num_computed_tokens", "num_draft_computed_tokens")
SOURCES = sorted(TIERS.rglob("*.py"))


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_every_sub_package_is_read() -> None:
    """Catches the scans below looking at the top folder only (a sub-package escaped every
    check while they used ``glob("*.py")``)."""
    names = {_name(p) for p in SOURCES}
    assert {"tiers.engine.llm_engine", "tiers.core.sched.scheduler", "tiers.layers.quantization"} <= names


def test_the_circle_finder_sees_circles_through_function_level_and_type_checking_imports(
    tmp_path: Path,
) -> None:
    """The finder itself: a planted circle across sub-packages (a -> b at module level, b -> c
    inside a function, c -> a under TYPE_CHECKING) is found whole, and a chain without one is not."""
    pkg = tmp_path / "tiers"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tiers.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from tiers import c\n    return c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tiers.a import thing\n"
    )
    (pkg / "d.py").write_text("import tiers.a\n")
    graph = import_graph(tmp_path, ("tiers",))
    assert graph["tiers.a"] == {"tiers.sub.b"} and graph["tiers.d"] == {"tiers.a"}
    assert [sorted(c) for c in circles(graph)] == [["tiers.a", "tiers.c", "tiers.sub.b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_inside_tiers() -> None:
    """Catches modules that cannot be read apart: device <-> engine <-> request and
    fast_forward <-> model_runner were circles before issue 34."""
    graph = import_graph(ROOT, ("tiers",))
    assert "tiers.core.sched.scheduler" in graph["tiers.engine.llm_engine"]  # the real package was read
    assert circles(graph) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TIERS)))
def test_no_file_in_tiers_is_over_its_size(path: Path) -> None:
    """Catches a module growing back into several jobs (engine.py held seven in 870 lines)."""
    lines = len(path.read_text().splitlines())
    limit = MAX_ENGINE_LINES if path.name == "llm_engine.py" else MAX_LINES
    assert lines <= limit, f"{path.relative_to(TIERS)} has {lines} lines (at most {limit})"


@pytest.mark.parametrize("package", ["router", "tiers", "classifier"])
def test_no_flat_package_holds_more_than_a_dozen_modules(package: str) -> None:
    """Catches a package flattening back into one room (``tiers/`` held 33 modules side by side)."""
    folders = {p.parent for p in (ROOT / package).rglob("*.py")}
    crowded = {
        str(f.relative_to(ROOT)): n
        for f in folders
        if (n := sum(1 for p in f.glob("*.py") if p.name != "__init__.py")) > MAX_MODULES
    }
    assert crowded == {}


def test_every_sub_package_says_what_lives_there() -> None:
    """Catches a room without its label: each ``__init__`` under ``tiers/`` opens with a docstring."""
    missing = [
        _name(p)
        for p in SOURCES
        if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert missing == []


def test_tiers_imports_nothing_of_the_service() -> None:
    """Catches the engine package reaching into the HTTP service or the classifier (it must run
    and be tested without them)."""
    modules = find_modules(ROOT, ("tiers", *SERVICE_PACKAGES))
    offenders = {
        name: bad
        for name, path in find_modules(ROOT, ("tiers",)).items()
        if (bad := sorted(m for m in imports_of(name, path, modules) if m.split(".")[0] in SERVICE_PACKAGES))
    }
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
    writers = {_name(p) for p in SOURCES if _writes(p)}
    assert "tiers.core.sched.scheduler" in writers  # the scan reached the real writer
    assert writers <= STATE_WRITERS, f"also written in {sorted(writers - STATE_WRITERS)}"


def test_the_engine_never_asks_which_kind_of_draft_it_has() -> None:
    """Catches drafting logic branching on the draft's type in the engine (six
    ``isinstance(self.draft, NgramProposer)`` branches before issue 34): proposers hide it."""
    tree = ast.parse((TIERS / "engine" / "llm_engine.py").read_text())
    checks = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
    ]
    assert not [c for c in checks if "Ngram" in c or "ModelRunner" in c or "draft" in c], checks
