"""The shape of ``classifier/`` (issue 53): sub-packages with a label, files within their size, and
the import direction training -> validation -> serving (read from the source, every import)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.router.test_import_graph import find_modules, imports_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "classifier"
MAX_LINES = 450
SOURCES = sorted(PACKAGE.rglob("*.py"))
SERVING = ("classifier.inference", "classifier.text", "classifier.data")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_in_classifier_is_over_its_size(path: Path) -> None:
    """Catches a module growing back into several jobs (outcome_train.py held 539 lines)."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines (at most {MAX_LINES})"


def test_every_sub_package_says_in_two_lines_what_lives_there_and_what_it_may_import() -> None:
    """Catches a room without its label (or a label that forgets the import rule)."""
    inits = [p for p in SOURCES if p.name == "__init__.py" and p.parent.name in ("training", "validation")]
    assert len(inits) == 2
    for path in inits:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert len(doc.splitlines()) == 2 and "may import" in doc.lower(), path


def _arrows() -> dict[str, set[str]]:
    modules = find_modules(ROOT, ("classifier",))
    return {name: set(imports_of(name, path, modules)) for name, path in modules.items()}


def test_validation_never_imports_training_and_serving_imports_neither() -> None:
    """Catches evaluation importing the training recipe (it is passed in: ``lofo=``) and the serving
    path pulling scikit-learn in through a training module."""
    arrows = _arrows()
    assert "classifier.validation.outcomes" in arrows["classifier.training.outcome_train"]  # the scan reads
    bad = {
        name: sorted(t for t in targets if t.startswith("classifier.training"))
        for name, targets in arrows.items()
        if name.startswith("classifier.validation") or name.startswith(SERVING)
    }
    assert {k: v for k, v in bad.items() if v} == {}
    serving = {
        name: sorted(t for t in targets if t.startswith("classifier.validation"))
        for name, targets in arrows.items()
        if name.startswith(SERVING)
    }
    assert {k: v for k, v in serving.items() if v} == {}
