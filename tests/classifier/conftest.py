"""Shared fixtures: the shipped classifier, loaded once per session."""

from __future__ import annotations

import pytest

from classifier import ComplexityClassifier


@pytest.fixture(scope="session")
def shipped() -> ComplexityClassifier:
    return ComplexityClassifier.load()
