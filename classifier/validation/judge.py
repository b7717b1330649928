"""The judge step of the learning loop: score logged answers, write outcome rows to train on.

Shadow mode (router/pipeline/shadow.py) logs, for a sample of requests, the served tier's answer and a
second tier's answer to the same prompt, with empty ``outcomes``. A *scorer* fills them in; the
judged lines then train a new routing score with ``classifier train --outcomes BASE --extra
judged.jsonl`` (lines about one answer - a judged shadow line and ``POST /v1/feedback`` on the
served answer - merge by ``id``), and ``POST /admin/classifier/reload`` swaps it in.

Scorers (``classifier judge --scorer``):

* ``exact``: the answer equals the prompt's reference after normalization (case, surrounding
  whitespace and punctuation, inner whitespace runs) - for tasks with one right string;
* ``number``: the last number in the answer equals the reference's (maths word problems, where
  the answer is reasoning followed by a result: GSM8K's own grading);
* ``contains``: the normalized reference occurs in the normalized answer.

References come from a JSONL file of ``{"prompt" | "id", "reference"}`` lines (by id first, then
by prompt). Answers logged without content, and prompts without a reference, are left unjudged
(counted in the summary, never guessed). A judge tier or a remote grader model fits the same
:class:`Scorer` shape (``(answer, reference) -> score in [0, 1]``); user feedback needs none.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["SCORERS", "Scorer", "judge_rows", "judge_shadow_log", "load_references", "normalize"]

Scorer = Callable[[str, str], float]

_SPACE = re.compile(r"\s+")
_EDGE = re.compile(r"^[\W_]+|[\W_]+$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize(text: str) -> str:
    """NFKC, lower case, whitespace runs as one space, punctuation stripped at both ends."""
    text = unicodedata.normalize("NFKC", text).lower()
    return _EDGE.sub("", _SPACE.sub(" ", text).strip())


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def exact_match(answer: str, reference: str) -> float:
    return 1.0 if normalize(answer) == normalize(reference) else 0.0


def number_match(answer: str, reference: str) -> float:
    got, want = _last_number(answer), _last_number(reference)
    return 1.0 if got is not None and want is not None and abs(got - want) < 1e-9 else 0.0


def contains_match(answer: str, reference: str) -> float:
    ref = normalize(reference)
    return 1.0 if ref and ref in normalize(answer) else 0.0


SCORERS: dict[str, Scorer] = {"exact": exact_match, "number": number_match, "contains": contains_match}


def load_references(path: str | Path) -> tuple[dict[str, str], dict[str, str]]:
    """``(by_id, by_prompt)`` from JSONL lines ``{"id"? , "prompt"?, "reference"}``."""
    by_id: dict[str, str] = {}
    by_prompt: dict[str, str] = {}
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        raw = json.loads(line)
        ref = raw.get("reference") if isinstance(raw, dict) else None
        if not isinstance(ref, str):
            raise ValueError(f"{path}:{lineno}: expected a string 'reference'")
        if isinstance(raw.get("id"), str):
            by_id[raw["id"]] = ref
        if isinstance(raw.get("prompt"), str):
            by_prompt[raw["prompt"]] = ref
        if not isinstance(raw.get("id"), str) and not isinstance(raw.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: a reference needs an 'id' or a 'prompt'")
    return by_id, by_prompt


def judge_rows(
    rows: Iterable[Mapping[str, Any]],
    scorer: Scorer,
    by_id: Mapping[str, str],
    by_prompt: Mapping[str, str],
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Judged copies of the shadow lines that have a reference, and a summary of what was skipped.

    Each judged line keeps its ``id`` and ``prompt`` and gets ``outcomes = {tier: score}`` for
    every tier whose answer was recorded (a score already in ``outcomes`` is kept: a person's
    judgement beats the scorer's), plus ``judge`` naming the reference's origin.
    """
    judged: list[dict[str, Any]] = []
    summary = {"lines": 0, "judged": 0, "no_reference": 0, "no_content": 0}
    for row in rows:
        summary["lines"] += 1
        answers = row.get("answers")
        prompt = row.get("prompt")
        if not isinstance(answers, Mapping) or not isinstance(prompt, str):
            summary["no_content"] += 1
            continue
        texts = {tier: a for tier, a in answers.items() if isinstance(a, str)}
        if len(texts) < 2:
            summary["no_content"] += 1
            continue
        rid = row.get("id")
        reference = by_id.get(rid) if isinstance(rid, str) else None
        if reference is None:
            reference = by_prompt.get(prompt)
        if reference is None:
            summary["no_reference"] += 1
            continue
        outcomes = {tier: scorer(text, reference) for tier, text in texts.items()}
        given = row.get("outcomes")
        if isinstance(given, Mapping):
            outcomes.update({k: float(v) for k, v in given.items() if isinstance(v, int | float)})
        out = {k: v for k, v in row.items() if k not in ("outcomes", "answers")}
        out["outcomes"] = outcomes
        out["judge"] = "reference by id" if isinstance(rid, str) and rid in by_id else "reference by prompt"
        judged.append(out)
        summary["judged"] += 1
    return judged, summary


def judge_shadow_log(
    log_path: str | Path,
    references: str | Path,
    out_path: str | Path,
    scorer: str | Scorer = "exact",
) -> dict[str, int]:
    """Judge a shadow log into ``out_path`` (JSONL, outcome rows); returns the summary."""
    score = SCORERS[scorer] if isinstance(scorer, str) else scorer
    by_id, by_prompt = load_references(references)
    lines = [
        json.loads(line) for line in Path(log_path).read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    judged, summary = judge_rows(lines, score, by_id, by_prompt)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in judged), encoding="utf-8")
    return summary
