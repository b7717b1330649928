"""Normalization shared by training and serving (classifier/text.py)."""

from __future__ import annotations

import re

import pytest

from classifier.text import (
    ASK_TOKENS,
    COUNT_FEATURES,
    HEAD_CHARS,
    MAX_CHARS,
    NEWLINE_MARK,
    TAIL_CHARS,
    WORD_TOKEN_PATTERN,
    ask_text,
    clean_text,
    count_features,
    model_text,
    model_views,
)


def test_short_text_is_untouched_and_not_truncated() -> None:
    assert clean_text("Hello, world!\nSecond line.") == ("Hello, world!\nSecond line.", False)


def test_long_text_keeps_head_and_tail() -> None:
    text = "H" * HEAD_CHARS + "x" * 1_000_000 + "T" * TAIL_CHARS
    cleaned, truncated = clean_text(text)
    assert truncated
    assert len(cleaned) <= MAX_CHARS + 1
    assert cleaned.startswith("H" * HEAD_CHARS)
    assert cleaned.endswith("T" * TAIL_CHARS)


def test_control_characters_nuls_and_line_separators() -> None:
    cleaned, _ = clean_text("a\x00b\x07c\u200bd\ufeffe\r\nf\rg\u2028h\x85i\tj")
    assert cleaned == "abcde\nf\ng\nh\ni\tj"


def test_lone_surrogates_become_replacement_characters() -> None:
    cleaned, _ = clean_text("ok \ud800 fine")
    cleaned.encode("utf-8")  # must not raise: onnxruntime needs UTF-8
    assert cleaned == "ok \ufffd fine"


@pytest.mark.parametrize("raw", [b"\xff\xfe binary \x00\x01", bytearray(b"plain bytes"), None, 12345])
def test_non_string_inputs(raw: object) -> None:
    cleaned, truncated = clean_text(raw)
    assert isinstance(cleaned, str)
    assert not truncated


def test_huge_bytes_are_cut_before_decoding() -> None:
    cleaned, truncated = clean_text("€".encode() * 1_000_000)
    assert truncated
    assert len(cleaned) <= MAX_CHARS + 1


def test_model_text_folds_case_digits_width_and_whitespace() -> None:
    text = model_text("Write  a 1,500-word\n\n  ESSAY ｆｕｌｌ-width ٣")
    assert text == f"write a 0,000-word {NEWLINE_MARK} {NEWLINE_MARK} essay full-width 0"


def test_model_text_strips_edges() -> None:
    assert model_text("\n\n  Hi \n") == "hi"
    assert model_text("") == ""


def test_ask_view_takes_both_ends() -> None:
    body = " ".join(f"w{i}" for i in range(100))
    text = model_text(f"Does this mention a dollar amount? yes/no\n\n{body}\nthanks")
    head, tail = ask_text(text).split(" | ")
    assert head.startswith("does this mention")
    assert tail == "thanks"
    one_line = model_text(body)
    head, tail = ask_text(one_line).split(" | ")
    assert len(head.split(" ")) == ASK_TOKENS
    assert tail.endswith("w00")  # digits fold to 0: "w99" -> "w00"


def test_model_views_is_a_pair() -> None:
    (full, ask), truncated = model_views("hi")
    assert (full, ask, truncated) == ("hi", "hi | hi", False)


def test_count_features() -> None:
    text = model_text('Hello world!\n- must do 12 items, and 3.5 "x"\n1. list {a}?')
    counts = dict(zip((name for name, _ in COUNT_FEATURES), count_features(text), strict=True))
    assert counts == {
        "tokens": 25,
        "lines": 2,
        "list_items": 2,
        "numbers": 4,
        "questions": 1,
        "clauses": 1,
        "code_symbols": 2,
        "quotes": 2,
        "constraints": 2,
    }


def test_token_pattern_is_engine_neutral() -> None:
    # Python's re and onnxruntime's RE2 differ on \w, \s and \b (Unicode vs ASCII): keep them out.
    for needle in (r"\w", r"\s", r"\b", r"\d"):
        assert needle not in WORD_TOKEN_PATTERN
    assert re.findall(WORD_TOKEN_PATTERN, "naïve 你好 a_b?") == ["na", "ï", "ve", "你", "好", "a_b", "?"]
