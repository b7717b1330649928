"""The ``shared_data`` marker (conftest.py): the rebuild checks skip visibly in a clone without
``../shared`` data and fail under ``CI=true``, so CI cannot pass them by skipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.classifier.conftest import pytest_runtest_setup


class Item:
    def __init__(self, path: Path) -> None:
        self.marks = [pytest.mark.shared_data(path).mark]

    def iter_markers(self, name: str) -> Any:
        return iter(m for m in self.marks if m.name == name)


@pytest.mark.parametrize("ci", ["", "false", "0"])
def test_missing_data_is_a_visible_skip_outside_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setenv("CI", ci)
    missing = tmp_path / "mmlu_outcomes.jsonl.gz"
    with pytest.raises(pytest.skip.Exception, match=r"mmlu_outcomes\.jsonl\.gz is missing"):
        pytest_runtest_setup(Item(missing))  # type: ignore[arg-type]


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_missing_data_fails_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        pytest_runtest_setup(Item(tmp_path / "absent.jsonl.gz"))  # type: ignore[arg-type]


def test_present_data_runs_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    present = tmp_path / "data.jsonl.gz"
    present.write_bytes(b"x")
    pytest_runtest_setup(Item(present))  # type: ignore[arg-type]  # neither skips nor fails
