"""Request building for in-process tiers (router/backends/local.py), without a model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from router.backends.local import _logit_bias, system_fingerprint
from router.errors import BadRequestError


def _tier(vocab: int) -> Any:
    return SimpleNamespace(name="small", tokenizer=[0] * vocab)


def test_logit_bias_outside_the_vocabulary_is_a_400_naming_the_field() -> None:
    assert _logit_bias(_tier(100), {"5": -100.0, "99": 2}) == ((5, -100.0), (99, 2.0))
    with pytest.raises(BadRequestError) as err:
        _logit_bias(_tier(100), {"100": 1.0})
    assert err.value.param == "logit_bias" and "100 tokens" in str(err.value)


def test_system_fingerprint_changes_exactly_with_the_serving_configuration() -> None:
    a = system_fingerprint("small", ("embedded", "int4", 64))
    assert a == system_fingerprint("small", ("embedded", "int4", 64))
    assert a != system_fingerprint("small", ("embedded", "int4", 32))
    assert a != system_fingerprint("medium", ("embedded", "int4", 64))
    assert a.startswith("fp_") and len(a) == 13
