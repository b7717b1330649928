"""Shared fixtures: the shipped classifier, loaded once per session; the ``shared_data`` marker.

``@pytest.mark.shared_data(path)`` marks a test that needs a data file from outside the
repository (``../shared/data``: the outcome data the shipped routing score is rebuilt from). In a
clone without it the test is skipped with the path as the reason; under ``CI=true`` a missing
file fails the test, so a CI run that silently lost the data cannot report the rebuild checks as
passed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from classifier import ComplexityClassifier


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "shared_data(path): needs this file from ../shared (skipped without it; CI=true fails)"
    )


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("shared_data"):
        path = Path(mark.args[0])
        if path.is_file():
            continue
        if in_ci():
            pytest.fail(f"CI=true and {path} is missing: this check must run in CI", pytrace=False)
        pytest.skip(f"{path} is missing (../shared data not in this clone; CI=true makes this a failure)")


@pytest.fixture(scope="session")
def shipped() -> ComplexityClassifier:
    return ComplexityClassifier.load()
