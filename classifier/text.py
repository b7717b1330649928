"""Text normalization shared by training and serving.

Everything here is pure Python (no numpy, no scikit-learn) so that the serving path stays light.
The ONNX graph receives the output of :func:`model_text`; training applies the very same function,
so whatever the graph's string operators cannot do (Unicode case folding, NFKC, digit folding,
whitespace collapsing) is done once, here, identically on both sides.

The regular expressions that the graph itself evaluates (word tokens, count features) are also
defined here. The token regex must mean the same in Python's ``re`` (training) and in RE2
(onnxruntime's Tokenizer): so no ``\\w``/``\\s``/``\\b``, which are Unicode-aware in Python and
ASCII-only in RE2.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from itertools import pairwise

__all__ = [
    "ASK_SEPARATOR",
    "ASK_TOKENS",
    "COUNT_FEATURES",
    "HEAD_CHARS",
    "MAX_CHARS",
    "NEWLINE_MARK",
    "OUTCOME_GROUPS",
    "TAIL_CHARS",
    "TOTAL_TOKENS",
    "WORD_TOKEN_PATTERN",
    "ask_text",
    "clean_text",
    "count_features",
    "model_text",
    "model_views",
    "views",
]

# Inputs longer than MAX_CHARS keep their head and tail: the ask usually sits at the start or the
# end of a long paste, and a bounded input bounds the scoring time (1 MB scores like 4 kB).
HEAD_CHARS = 3000
TAIL_CHARS = 1000
MAX_CHARS = HEAD_CHARS + TAIL_CHARS

# Newlines carry structure (lists, code, pasted documents). The graph's tokenizer regex "." does
# not match "\n", so newlines become a visible token instead of silently vanishing.
NEWLINE_MARK = "¶"

# The "ask" view: the first ASK_TOKENS words of the first line and the last ASK_TOKENS words of
# the last line. In a prompt that pastes a document, code or a long story, the instruction sits
# at one end; a TF-IDF of this view lets "yes/no?" after a long paste, or a terse expert ask,
# weigh for what they are instead of being diluted by the rest.
ASK_TOKENS = 25
ASK_SEPARATOR = "|"

# Tokens for the word TF-IDF: ASCII alphanumeric runs, or any single other non-space character
# (punctuation, code symbols, and each CJK character on its own).
WORD_TOKEN_PATTERN = r"[a-z0-9_]+|[^ a-z0-9_]"

# Count features: log1p of how many word tokens (or token bigrams, written "a b") fall in each
# group. They give the linear model absolute quantities that L2-normalized TF-IDF rows lose. The
# graph computes them from one tokenization with one n-gram counter and a grouping matrix, which
# costs a few microseconds (one regex Tokenizer per feature would cost far more).
TOTAL_TOKENS = "tokens"
COUNT_FEATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (TOTAL_TOKENS, ()),  # every token: the length of the prompt
    ("lines", (NEWLINE_MARK,)),
    ("list_items", tuple(f"{NEWLINE_MARK} {m}" for m in ("-", "*", "•", "0"))),
    ("numbers", tuple("0" * k for k in range(1, 9))),
    ("questions", ("?",)),
    ("clauses", (",", ";", ":")),
    ("code_symbols", tuple("`{}()[]=<>#$|\\/")),
    ("quotes", tuple('"“”«»「」')),
    (
        "constraints",
        (
            "must",
            "should",
            "include",
            "including",
            "without",
            "each",
            "every",
            "exactly",
            "least",
            "most",
            "under",
            "within",
            "words",
            "steps",
            "table",
            "tables",
            "format",
            "ensure",
            "avoid",
            "limit",
            "only",
            "both",
            "also",
            "then",
            "plus",
            "per",
            "and",
        ),
    ),
)

# Groups for the outcome-trained routing score: the same counts, plus domain cues. The strong model
# of a weak/strong pair gains most on maths, multi-step reasoning and code, least on writing,
# role-play, chat and simple facts (RouteLLM's MT-Bench categories; MMLU per subject). Word lists
# generalize across benchmarks where a TF-IDF vocabulary learned on one benchmark's topics does
# not (classifier/README.md, "Routing score", shows the measurements). Counting them costs no
# more than the counts above: one n-gram counter over the union of all groups.
OUTCOME_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    *COUNT_FEATURES,
    ("sentences", (".", "!")),  # with "questions" above: how many steps the prompt spells out
    ("math_symbols", tuple("+*^=%")),
    (
        "math_words",
        (
            "calculate",
            "compute",
            "solve",
            "equation",
            "equations",
            "sum",
            "total",
            "average",
            "percent",
            "probability",
            "ratio",
            "fraction",
            "integer",
            "integers",
            "divisible",
            "digits",
            "digit",
            "prove",
            "proof",
            "theorem",
            "how many",
            "how much",
            "how old",
            "how long",
            "how far",
            "altogether",
            "combined",
            "percentage",
            "twice",
            "half",
            "remaining",
            "left",
            "times",
            "more than",
            "fewer",
            "less than",
            "cost",
            "costs",
            "price",
            "earn",
            "earns",
            "pays",
            "paid",
            "$",
            "km",
            "hours",
            "minutes",
            "speed",
            "rate",
            "area",
            "perimeter",
            "volume",
            "dozen",
            "x",
            "y",
            "f",
            "real",
            "value",
            "expression",
            "simplify",
        ),
    ),
    (
        "code",
        (
            "python",
            "code",
            "program",
            "implement",
            "algorithm",
            "def",
            "return",
            "class",
            "sql",
            "query",
            "java",
            "javascript",
            "const",
            "= >",
            "c +",
            "rust",
            "function",
            "array",
            "string",
            "bug",
            "error",
            "compile",
            "regex",
            "regular expression",
            "complexity",
            "api",
            "script",
            "recursion",
            "recursive",
            "loop",
            "variable",
            "import",
            "print",
            "tree",
            "graph",
            "linked list",
            "o (",
            "time complexity",
            "debug",
            "unit tests",
            "tests",
            "thread",
        ),
    ),
    (
        "reasoning",
        (
            "puzzle",
            "logic",
            "logical",
            "riddle",
            "deduce",
            "infer",
            "therefore",
            "true",
            "false",
            "lying",
            "truth",
            "if",
            "arrangement",
            "possible",
            "step by",
            "explain why",
            "why",
            "order",
            "before",
            "after",
            "older",
            "younger",
            "taller",
            "follows",
            "follow",
            "conclusion",
            "assume",
            "suppose",
            "given",
            "justify",
            "reason",
            "each",
            "every",
        ),
    ),
    (
        "writing",
        (
            "write",
            "essay",
            "poem",
            "story",
            "blog",
            "email",
            "letter",
            "compose",
            "draft",
            "rewrite",
            "tone",
            "catchy",
            "slogan",
            "speech",
            "toast",
            "haiku",
            "limerick",
            "review",
            "description",
            "creative",
            "paragraph",
            "post",
            "song",
            "lyrics",
            "narrative",
            "persuasive",
            "engaging",
            "funny",
            "heartfelt",
            "message",
            "card",
        ),
    ),
    (
        "roleplay",
        (
            "pretend",
            "role",
            "persona",
            "embody",
            "you are",
            "character",
            "act as",
            "act like",
            "in character",
            "dialogue",
        ),
    ),
    (
        "chat",
        (
            "hi",
            "hello",
            "hey",
            "thanks",
            "thank",
            "please",
            "recommend",
            "suggest",
            "ideas",
            "tips",
            "fun",
            "favorite",
            "favourite",
            "best",
            "good",
            "tell me",
            "what is",
            "who is",
            "capital",
            "describe",
            "summarize",
            "history",
            "culture",
            "explain",
        ),
    ),
    # Lettered option markers ("A." or "(A)"): three or more make a multiple-choice exam question,
    # on which the routing score gates its domain cues off (classifier/outcome_train.py). A bare
    # "Answer:" does not: few-shot maths prompts end that way and are not multiple choice.
    ("choices", ("a .", "b .", "c .", "d .", "a )", "b )", "c )", "d )")),
)

_WORD_TOKEN = re.compile(WORD_TOKEN_PATTERN)
# Anything that needs work in clean_text: C0/C1 controls but \t and \n (\r included), Unicode
# line separators, zero-width and byte-order marks, non-characters. One search finds none of it
# in ordinary text, which then passes untouched.
_SPECIAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\u2060\ufeff\ufffe\uffff]")
_LINE_BREAKS = re.compile("\r\n?|[\u2028\u2029\x85]")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2060\ufeff\ufffe\uffff]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_DIGIT = re.compile(r"\d")
_ASCII_DIGITS = str.maketrans("123456789", "000000000")


def clean_text(text: object) -> tuple[str, bool]:
    """Make any input safe to score: returns ``(text, truncated)``.

    Accepts ``str`` or ``bytes`` (anything else goes through ``str()``). Long inputs keep their
    first HEAD_CHARS and last TAIL_CHARS characters *before* any other work, so the cost is bounded
    whatever the size. Lone surrogates (not encodable as UTF-8, which onnxruntime requires) become
    U+FFFD; NULs and other control characters are dropped.
    """
    cut_bytes = False
    if isinstance(text, bytes | bytearray | memoryview):
        raw = bytes(text)
        # At most 4 bytes per character: cut before decoding so decoding is bounded too.
        cut_bytes = len(raw) > 4 * MAX_CHARS
        if cut_bytes:
            raw = raw[: 4 * HEAD_CHARS] + b"\n" + raw[-4 * TAIL_CHARS :]
        text = raw.decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = "" if text is None else str(text)
    truncated = len(text) > MAX_CHARS
    if truncated:
        text = text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]
    truncated = truncated or cut_bytes
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATE.sub("\ufffd", text)
    if _SPECIAL.search(text):
        text = _CONTROL.sub("", _LINE_BREAKS.sub("\n", text))
    return text, truncated


def model_text(text: str) -> str:
    """The exact string the ONNX graph sees (apply to the output of :func:`clean_text`).

    NFKC folds full-width and compatibility forms; lower-casing happens here because Python's is
    Unicode-correct and the graph's StringNormalizer depends on OS locales; digits fold to "0" so
    that "1,500-word" and "2,500-word" are one pattern; newlines become NEWLINE_MARK and all other
    whitespace runs a single space (scikit-learn's char analyzer does the latter too, the graph
    does not).
    """
    text = unicodedata.normalize("NFKC", text).lower().strip()
    # translate() is several times faster than a regex, but knows only ASCII digits.
    text = text.translate(_ASCII_DIGITS) if text.isascii() else _DIGIT.sub("0", text)
    if "\n" in text:
        text = text.replace("\n", f" {NEWLINE_MARK} ")
    return " ".join(text.split())


def ask_text(text: str) -> str:
    """The ask view of a :func:`model_text` string (see ASK_TOKENS)."""
    lines = [line for line in (part.strip() for part in text.split(NEWLINE_MARK)) if line] or [""]
    head, tail = lines[0].split(" ")[:ASK_TOKENS], lines[-1].split(" ")[-ASK_TOKENS:]
    return f"{' '.join(head)} {ASK_SEPARATOR} {' '.join(tail)}"


def views(cleaned: str) -> list[str]:
    """``[full, ask]``: one row of the graph's ``text`` input, from :func:`clean_text` output."""
    full = model_text(cleaned)
    return [full, ask_text(full)]


def model_views(text: object) -> tuple[list[str], bool]:
    """``([full, ask], truncated)``: one row of the graph's ``text`` input, from any raw input."""
    cleaned, truncated = clean_text(text)
    return views(cleaned), truncated


def count_features(text: str, groups: tuple[tuple[str, tuple[str, ...]], ...] = COUNT_FEATURES) -> list[int]:
    """Python twin of the graph's count features (training side; inputs are model_text output)."""
    tokens = _WORD_TOKEN.findall(text)
    grams = Counter(tokens)
    grams.update(f"{a} {b}" for a, b in pairwise(tokens))
    return [len(tokens) if name == TOTAL_TOKENS else sum(grams[g] for g in group) for name, group in groups]
