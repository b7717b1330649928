"""The corpus and its deterministic split (classifier/data)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from classifier.data import (
    HELDOUT_PATH,
    LABELS,
    PARTS,
    TRAIN_PATH,
    dedupe,
    load_jsonl,
    load_parts,
    stable_split,
    write_split,
)


def _key(prompt: str) -> str:
    return " ".join(prompt.casefold().split())


def test_committed_split_is_what_the_parts_give(tmp_path: Path) -> None:
    counts = write_split(out_dir=tmp_path)
    assert (tmp_path / "train.jsonl").read_bytes() == TRAIN_PATH.read_bytes()
    assert (tmp_path / "heldout.jsonl").read_bytes() == HELDOUT_PATH.read_bytes()
    assert counts["train"] + counts["heldout"] + counts["duplicates_dropped"] == counts["parts"]


def test_split_is_about_80_20_in_every_part_and_label() -> None:
    train = Counter((r["part"], r["label"]) for r in load_jsonl(TRAIN_PATH))
    heldout = Counter((r["part"], r["label"]) for r in load_jsonl(HELDOUT_PATH))
    assert set(train) == set(heldout) == {(p, label) for p in PARTS for label in LABELS}
    for group, n in heldout.items():
        assert abs(n / (n + train[group]) - 0.2) < 0.01, group


def test_no_prompt_on_both_sides() -> None:
    train = {_key(r["prompt"]) for r in load_jsonl(TRAIN_PATH)}
    heldout = {_key(r["prompt"]) for r in load_jsonl(HELDOUT_PATH)}
    assert not train & heldout


def test_every_row_is_labeled_and_parts_are_balanced() -> None:
    rows = load_parts()
    assert len(rows) > 3500
    assert all(r["label"] in LABELS and r["prompt"].strip() for r in rows)
    shares = Counter(r["label"] for r in rows)
    assert min(shares.values()) / max(shares.values()) > 0.9


def test_split_ignores_row_order_and_depends_on_salt() -> None:
    rows = dedupe(load_parts())
    _, forward = stable_split(rows, 0.2)
    _, backward = stable_split(rows[::-1], 0.2)
    assert {r["prompt"] for r in forward} == {r["prompt"] for r in backward}
    _, other = stable_split(rows, 0.2, salt="validation")
    assert {r["prompt"] for r in other} != {r["prompt"] for r in forward}


def test_dedupe_keeps_first_of_normalized_duplicates() -> None:
    rows = [{"prompt": "Good morning!"}, {"prompt": "good   morning :)"}, {"prompt": "good evening"}]
    assert [r["prompt"] for r in dedupe(rows)] == ["Good morning!", "good evening"]
