"""Incremental detokenization: UTF-8 held back until complete, stop strings never leak."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiers.core.output import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for tok in tokenizer.encode(text, add_special_tokens=False):
        detok.add(tok)
        pieces.append(detok.take())
        if detok.stopped:
            break
    pieces.append(detok.take(final=True))
    return pieces, detok


def test_deltas_concatenate_to_the_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Unicode: café naïve 東京 😀 and more"
    pieces, _ = stream(tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_streamed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    pieces, detok = stream(tokenizer, "Hello there! How can I help you today?", stop=("How can",))
    assert detok.stopped
    assert "".join(pieces) == "Hello there! "
    assert not any("How" in p for p in pieces)


def test_partial_stop_prefix_is_released_when_it_diverges(tokenizer) -> None:  # type: ignore[no-untyped-def]
    pieces, detok = stream(tokenizer, "the quick brown fox", stop=("the lazy",))
    assert not detok.stopped
    assert "".join(pieces) == "the quick brown fox"
