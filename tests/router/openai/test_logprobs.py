"""The wire shapes of logprobs (router/openai/logprobs.py), on the tiny byte-level BPE tokenizer
and on a stand-in tokenizer whose pieces are known: each token's ``bytes`` are its exact UTF-8
bytes (a character split across tokens rejoins to the text's own bytes), ``-inf`` is reported at
OpenAI's floor, alternatives are cut at ``top``, and a completion's ``text_offset`` counts from
the given offset with the echoed prompt's first token carrying no logprob."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from router.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    prompt_completion_logprobs,
    token_texts,
)
from tiers.core.output import TokenLogprob


class _Pieces:
    """Token id i decodes to PIECES[i]; not byte-level, so ``decode`` is used."""

    PIECES: tuple[str, ...] = ("Hel", "lo", " wor", "ld", "!")
    all_special_ids: tuple[int, ...] = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.PIECES[i] for i in ids)


def test_byte_level_tokens_carry_their_exact_bytes(tiny_model_dir: Path) -> None:
    """Bug it catches: a token's bytes taken from its decoded text - the halves of a character
    split across two tokens become two U+FFFD and their bytes no longer rejoin to the text."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = TokenTexts(tok)
    text = "héllo wörld 🌍 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert texts._byte_level  # the byte-table path, not decode()
    joined = b"".join(bytes(texts.get(i)[1]) for i in ids)
    assert joined == text.encode()
    assert any("\ufffd" in texts.get(i)[0] for i in ids)  # a character did split across tokens
    assert token_texts(tok) is token_texts(tok)  # one table per tokenizer


def _entry(token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
    return TokenLogprob(token, logprob, top)


def test_chat_items_cut_alternatives_at_top_and_floor_minus_infinity() -> None:
    texts = TokenTexts(_Pieces())
    entries = [_entry(0, -0.1, [(0, -0.1), (1, -2.0), (2, float("-inf"))]), _entry(4, float("-inf"), [])]
    items = chat_logprobs(texts, entries, 2)
    assert items[0] == {
        "token": "Hel",
        "logprob": -0.1,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
            {"token": "lo", "logprob": -2.0, "bytes": list(b"lo")},
        ],
    }
    assert items[1]["logprob"] == -9999.0 and items[1]["top_logprobs"] == []
    assert chat_logprobs(texts, entries, 0)[0]["top_logprobs"] == []
    assert chat_logprobs(texts, entries, 3)[0]["top_logprobs"][2]["logprob"] == -9999.0


def test_completion_offsets_count_from_the_given_offset() -> None:
    """Bug it catches: offsets counted from 0 for a later chunk of a streamed answer (or from the
    start of the token instead of its end), so a client's text positions drift."""
    texts = TokenTexts(_Pieces())
    entries = [_entry(i, -float(i), [(i, -float(i)), (4, -5.0)]) for i in range(4)]
    lp = completion_logprobs(texts, entries, 1, offset=10)
    assert lp["tokens"] == ["Hel", "lo", " wor", "ld"]
    assert lp["text_offset"] == [10, 13, 15, 19]
    assert lp["token_logprobs"] == [0.0, -1.0, -2.0, -3.0]
    assert lp["top_logprobs"] == [{"Hel": 0.0}, {"lo": -1.0}, {" wor": -2.0}, {"ld": -3.0}]


def test_the_echoed_prompts_first_token_has_no_logprob_and_parts_merge_in_order() -> None:
    texts = TokenTexts(_Pieces())
    head = prompt_completion_logprobs(texts, [0, 1], [None, _entry(1, -0.5, [(1, -0.5)])], 1)
    assert head["tokens"] == ["Hel", "lo"] and head["text_offset"] == [0, 3]
    assert head["token_logprobs"] == [None, -0.5] and head["top_logprobs"] == [None, {"lo": -0.5}]
    tail = completion_logprobs(texts, [_entry(4, -1.0, [])], 1, offset=5)
    merged = merge_completion_logprobs([head, tail])
    assert merged["tokens"] == ["Hel", "lo", "!"] and merged["text_offset"] == [0, 3, 5]
    assert merged["token_logprobs"] == [None, -0.5, -1.0]


@pytest.mark.parametrize("top", [1, 2])
def test_alternatives_with_the_same_text_keep_the_first(top: int) -> None:
    class Same(_Pieces):
        PIECES = ("a", "a")

    lp = completion_logprobs(TokenTexts(Same()), [_entry(0, -1.0, [(0, -1.0), (1, -3.0)])], top)
    assert lp["top_logprobs"] == [{"a": -1.0}]
