"""Feedback's score (router/pipeline/feedback.py, ``_score``): exactly one of ``score`` or
``thumbs``, a score at both ends of [0, 1] accepted (0.0 is a score, not a missing one) and one
past refused, thumbs as 1 / 0, each refusal naming its field."""

from __future__ import annotations

import msgspec
import pytest

from router.errors import BadRequestError
from router.pipeline.feedback import FeedbackBody, _score


def _body(**fields: object) -> FeedbackBody:
    return msgspec.convert({"id": "chatcmpl-1", **fields}, FeedbackBody)


@pytest.mark.parametrize("value", [0.0, 0, 1.0, 1, 0.25])
def test_a_score_in_range_is_taken_as_given(value: float) -> None:
    """Bug it catches: ``score: 0`` (the worst answer) read as no score, or 1.0 refused."""
    assert _score(_body(score=value)) == float(value)


@pytest.mark.parametrize("value", [-0.001, 1.001, float("inf"), float("nan")])
def test_a_score_out_of_range_is_refused_naming_score(value: float) -> None:
    with pytest.raises(BadRequestError) as err:
        _score(_body(score=value))
    assert err.value.param == "score"


def test_thumbs_up_and_down_and_anything_else_refused() -> None:
    assert _score(_body(thumbs="up")) == 1.0
    assert _score(_body(thumbs="down")) == 0.0
    with pytest.raises(BadRequestError) as err:
        _score(_body(thumbs="sideways"))
    assert err.value.param == "thumbs"


@pytest.mark.parametrize("fields", [{}, {"score": 1.0, "thumbs": "up"}, {"score": 0.0, "thumbs": "down"}])
def test_exactly_one_of_score_and_thumbs(fields: dict[str, object]) -> None:
    with pytest.raises(BadRequestError) as err:
        _score(_body(**fields))
    assert err.value.param == "score" and "exactly one" in err.value.message
