"""The labeled corpus: hand-written parts, and the deterministic train / held-out split.

``classifier/data/parts/*.jsonl`` are the source of truth. ``train.jsonl`` and ``heldout.jsonl``
are derived from them by :func:`write_split` (``python -m classifier.data``) and committed, so that
anyone can check that the split is what the parts say it is.

The split never depends on a random state: each prompt gets a stable key, the SHA-256 of its
normalized text (with a salt naming the split), and within every (part, label) group the prompts
with the smallest keys go to the held-out side. That makes the split stratified by part and label,
reproducible on any machine and Python version, and independent of file order. Exact duplicates
(after normalizing case, spacing and punctuation) are dropped before splitting, keeping the first,
so a prompt can never sit on both sides.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_DIR",
    "HELDOUT_PATH",
    "LABELS",
    "PARTS",
    "PARTS_DIR",
    "TRAIN_PATH",
    "Example",
    "dedupe",
    "load_jsonl",
    "load_parts",
    "stable_split",
    "write_jsonl",
    "write_split",
]

LABELS: tuple[str, ...] = ("small", "medium", "large")
DATA_DIR = Path(__file__).resolve().parent
PARTS_DIR = DATA_DIR / "parts"
PARTS: tuple[str, ...] = ("general", "technical", "professional")
TRAIN_PATH = DATA_DIR / "train.jsonl"
HELDOUT_PATH = DATA_DIR / "heldout.jsonl"
HELDOUT_FRACTION = 0.2

Example = dict[str, Any]

_NOT_WORD = re.compile(r"[\W_]+")


def load_jsonl(path: str | Path) -> list[Example]:
    """Read ``{"prompt", "label"?}`` lines; blank lines are skipped, a bad label is an error."""
    rows: list[Example] = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'prompt'")
            label = row.get("label")
            if label is not None and label not in LABELS:
                raise ValueError(f"{path}:{lineno}: label {label!r} is not one of {LABELS}")
            rows.append(row)
    return rows


def write_jsonl(path: str | Path, rows: Iterable[Example]) -> None:
    with Path(path).open("w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_parts(parts_dir: str | Path = PARTS_DIR) -> list[Example]:
    """All parts in a fixed order, each row tagged with its ``part`` (the file stem)."""
    rows: list[Example] = []
    for part in PARTS:
        for row in load_jsonl(Path(parts_dir) / f"{part}.jsonl"):
            if row.get("label") is None:
                raise ValueError(f"part {part}: every prompt needs a label")
            rows.append({"prompt": row["prompt"], "label": row["label"], "part": part})
    return rows


def _norm_key(prompt: str) -> str:
    return _NOT_WORD.sub(" ", prompt.casefold()).strip()


def dedupe(rows: Sequence[Example]) -> list[Example]:
    """Drop rows whose normalized prompt was already seen (first occurrence wins)."""
    seen: set[str] = set()
    out: list[Example] = []
    for row in rows:
        key = _norm_key(row["prompt"])
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def _hash_key(prompt: str, salt: str) -> str:
    return hashlib.sha256(f"{salt}\x00{_norm_key(prompt)}".encode()).hexdigest()


def stable_split(
    rows: Sequence[Example], fraction: float, salt: str = "heldout", strata: Sequence[str] = ("part", "label")
) -> tuple[list[Example], list[Example]]:
    """Split ``rows`` into ``(rest, selected)``; ``selected`` holds ``round(fraction * n)`` per stratum.

    Rows keep their input order on both sides. A different ``salt`` gives an independent split
    (training carves its validation split from train.jsonl with ``salt="validation"``).
    """
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[tuple(row.get(s) for s in strata)].append(i)
    chosen: set[int] = set()
    for idx in groups.values():
        ranked = sorted(idx, key=lambda i: _hash_key(rows[i]["prompt"], salt))
        chosen.update(ranked[: round(fraction * len(idx))])
    rest = [r for i, r in enumerate(rows) if i not in chosen]
    selected = [r for i, r in enumerate(rows) if i in chosen]
    return rest, selected


def write_split(
    parts_dir: str | Path = PARTS_DIR, out_dir: str | Path = DATA_DIR, fraction: float = HELDOUT_FRACTION
) -> dict[str, int]:
    """Regenerate ``train.jsonl`` and ``heldout.jsonl`` from the parts; returns the counts."""
    rows = load_parts(parts_dir)
    unique = dedupe(rows)
    train, heldout = stable_split(unique, fraction, salt="heldout")
    write_jsonl(Path(out_dir) / "train.jsonl", train)
    write_jsonl(Path(out_dir) / "heldout.jsonl", heldout)
    return {
        "parts": len(rows),
        "duplicates_dropped": len(rows) - len(unique),
        "train": len(train),
        "heldout": len(heldout),
    }
