"""OpenAI ``logprobs`` objects from the engine's ``TokenLogprob`` entries.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``.
Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``. A token's ``token`` is its text; a token that is only part of a UTF-8 character
has no text of its own, and its ``bytes`` (always exact) are what a client joins.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from tiers.core.output import TokenLogprob

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs", "prompt_completion_logprobs", "token_texts"]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: each printable stand-in char -> its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenTexts:
    """Per tokenizer: the exact bytes and display text of each token id (memoized)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is not None:
            return found
        raw: bytes | None = None
        if self._byte_level and token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(piece, str) and all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
        if raw is None:
            raw = str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()
        text = raw.decode("utf-8", errors="replace")
        found = (text, list(raw))
        self._cache[token_id] = found
        return found


_texts: dict[int, tuple[Any, TokenTexts]] = {}
_lock = threading.Lock()


def token_texts(tokenizer: Any) -> TokenTexts:
    with _lock:
        found = _texts.get(id(tokenizer))
        if found is None or found[0] is not tokenizer:
            found = (tokenizer, TokenTexts(tokenizer))
            _texts[id(tokenizer)] = found
        return found[1]


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = texts.get(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": raw}


def _finite(x: float) -> float:
    # -inf (a token the mask ruled out, reported as an alternative) is not JSON; OpenAI's floor.
    return max(float(x), -9999.0)


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """The ``content`` items of a chat ``logprobs`` object."""
    out = []
    for e in entries:
        item = _entry(texts, e.token_id, e.logprob)
        item["top_logprobs"] = [_entry(texts, t, lp) for t, lp in e.top[:top]]
        out.append(item)
    return out


def completion_logprobs(
    texts: TokenTexts, entries: list[TokenLogprob | None], top: int, offset: int = 0
) -> dict[str, Any]:
    """A legacy completions ``logprobs`` object; ``None`` entries (the first echoed prompt token)
    have no logprob. ``offset``: the text offset of the first token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = offset
    for e in entries:
        if e is None:
            tokens.append("")
            token_logprobs.append(None)
            tops.append(None)
            offsets.append(pos)
            continue
        text, _ = texts.get(e.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(e.logprob))
        alts: dict[str, float] = {}
        for t, lp in e.top[:top]:
            alts.setdefault(texts.get(t)[0], _finite(lp))
        tops.append(alts)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_completion_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[TokenLogprob | None], top: int
) -> dict[str, Any]:
    """The echoed prompt's part of a legacy completions ``logprobs`` object: every prompt token's
    text and offset, ``null`` logprob and alternatives for the first (nothing precedes it)."""
    filled: list[TokenLogprob | None] = [
        e if e is not None else TokenLogprob(t, 0.0, []) for t, e in zip(token_ids, entries, strict=True)
    ]
    out = completion_logprobs(texts, filled, top)
    for i, e in enumerate(entries):
        if e is None:
            out["token_logprobs"][i] = None
            out["top_logprobs"][i] = None
    return out


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k, values in merged.items():
            values.extend(p[k])
    return merged
