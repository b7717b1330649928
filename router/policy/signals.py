"""Request signals for policy conditions that need more than a comparison: keywords and language.

Pure functions, cached: ``decide()`` may test many rules against one request, and the same
keyword lists against every request, so patterns compile once per list and a text's language is
detected once.

Language detection is a heuristic, deliberately small (no model, no dependency, a few
microseconds): the dominant Unicode script decides for scripts that one language mostly owns
(kana: ja, hangul: ko, han: zh, cyrillic: ru, arabic: ar, hebrew: he, greek: el, devanagari:
hi, thai: th); Latin text is assigned to the language whose stop words it uses most among en,
es, fr, de, it, pt, nl. Anything unclear (too short, a tie, no stop words) is ``und``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["detect_language", "keyword_pattern", "matches_keywords"]

_SAMPLE_CHARS = 2000

_STOPWORD_TEXT = {
    "en": "the and is are of to in that it you for with on this what how was be not have can",
    "es": "el la los las de que y en un una es por con para no se del al como más pero",
    "fr": "le la les de des et en un une est que pour dans pas qui sur au du avec ce vous",
    "de": "der die das und ist nicht ein eine zu den mit von sich auf für ich es im dem wie",
    "it": "il lo la gli le di che e un una è per non con del della sono come ma anche",
    "pt": "o a os as de que e em um uma é para não com do da se por mais como mas você",
    "nl": "de het een en van is dat niet in op te zijn voor met ik je wat hoe maar",
}
_STOPWORDS = {lang: frozenset(words.split()) for lang, words in _STOPWORD_TEXT.items()}
_WORD = re.compile(r"[^\W\d_]+")
_SCRIPTS = (
    ("HIRAGANA", "ja"),
    ("KATAKANA", "ja"),
    ("HANGUL", "ko"),
    ("CJK", "zh"),
    ("CYRILLIC", "ru"),
    ("ARABIC", "ar"),
    ("HEBREW", "he"),
    ("GREEK", "el"),
    ("DEVANAGARI", "hi"),
    ("THAI", "th"),
    ("LATIN", "latin"),
)


def _script(ch: str) -> str | None:
    try:
        name = unicodedata.name(ch)
    except ValueError:
        return None
    for prefix, script in _SCRIPTS:
        if name.startswith(prefix):
            return script
    return None


@lru_cache(maxsize=4096)
def detect_language(text: str) -> str:
    """ISO 639-1 code of ``text``'s language, or ``und`` (see the module docstring)."""
    sample = text[:_SAMPLE_CHARS]
    counts: dict[str, int] = {}
    for ch in sample:
        if ch.isalpha():
            script = _script(ch)
            if script is not None:
                counts[script] = counts.get(script, 0) + 1
    if not counts:
        return "und"
    # Japanese mixes kana with han: any real share of kana makes it Japanese, not Chinese.
    if counts.get("ja", 0) >= 0.1 * sum(counts.values()):
        return "ja"
    script = max(counts, key=lambda k: counts[k])
    if script != "latin":
        return script
    words = [w.casefold() for w in _WORD.findall(sample)]
    votes = {lang: sum(w in stop for w in words) for lang, stop in _STOPWORDS.items()}
    best = max(votes, key=lambda k: votes[k])
    ranked = sorted(votes.values(), reverse=True)
    if ranked[0] == 0 or ranked[0] == ranked[1]:
        return "und"
    return best


@lru_cache(maxsize=1024)
def keyword_pattern(keywords: tuple[str, ...]) -> re.Pattern[str]:
    """One case-insensitive regex matching any of ``keywords`` as whole words (spacing-tolerant)."""
    parts = sorted(
        {r"\s+".join(map(re.escape, k.split())) for k in keywords if k.strip()}, key=len, reverse=True
    )
    return re.compile(r"(?<!\w)(?:" + "|".join(parts) + r")(?!\w)", re.IGNORECASE)


def matches_keywords(text: str, keywords: Sequence[str]) -> bool:
    return keyword_pattern(tuple(keywords)).search(text) is not None
