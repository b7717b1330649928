"""Inside one task family the routing score must keep the length signal (issue 32).

Free-form prompts (3.2): a maths word problem stays in the maths family whatever its "each",
"if" and "after" say (``MATHS_OVERRIDE``), and its dollar signs set no code-symbols flag outside
an exam question (``OutcomeConfig.flag_scope``), so the shipped score ranks word problems by
their length alone. 3.1 sent 27 % of GSM8K's problems to other families or flagged them, and
ranked them against their length (Spearman 0.68 with length, 3.2: 0.97; the hidden GSM8K check
rewards length, 0.599 APGR).

Exam questions: the shipped score ranks multiple-choice exam questions by length *and* by a
code-symbols flag that fires on the parentheses, slashes and dollar signs of prose questions:
within MMLU's ``other`` category that flag reorders prompts against their length and puts the
score below the prompt-length baseline (held-out APGR 0.579 vs 0.609). ``OutcomeConfig.gate_flags``
(:data:`~classifier.training.outcome_train.GATED_CONFIG`) gates the flag off on exam questions, so their
only varying column is the length. These tests pin that mechanism, in scikit-learn and in the
ONNX graph, and keep the shipped artifact's known gap visible as a strict xfail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from classifier.text import OUTCOME_GROUPS, model_text
from classifier.training.outcome_train import (
    CODE_OVERRIDE,
    DOMAIN_GROUPS,
    FLAG_GROUPS_GATED,
    GATED_CONFIG,
    OUTCOME_CONFIG,
    PREVIOUS_CONFIG,
    OutcomeConfig,
    fit_outcomes,
    outcome_proba,
)

ROOT = Path(__file__).resolve().parents[3]
MMLU = ROOT.parent / "shared/data/routing/mmlu_outcomes.jsonl.gz"
DIFFICULTY = ROOT.parent / "shared/data/routing/difficulty_7b.jsonl.gz"

OPTIONS = "\nA. one\nB. two\nC. three\nD. four\nAnswer:"
# Prose exam questions: the first ones carry three or more code symbols ((, ), /, $), the rest none.
SYMBOLIC = [
    "Which clause (if any) of the 1787 text covers this (see art. 2/3)?",
    "A firm's costs (fixed and variable) rose from $40 to $55 per unit/day; which cause is most likely?",
]
PLAIN = [
    "Which treaty ended the war?",
    "Which of the following best describes the main purpose of a central bank in a modern economy",
    "According to the passage, which of the following statements about the migration of the birds "
    "described by the author is best supported by the evidence given in the second paragraph",
]


def _exam(question: str) -> str:
    return question + OPTIONS


def _family_counts(
    gated: tuple[str, ...],
    overrides: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (CODE_OVERRIDE,),
    flag_scope: tuple[str, int] | None = None,
) -> Any:
    """FamilyCounts as the outcome score builds it; the defaults are 3.1's features."""
    from classifier.training.features import FamilyCounts

    counts = FamilyCounts(
        OUTCOME_GROUPS,
        gate="choices",
        gated=gated,
        gate_at=3,
        domains=DOMAIN_GROUPS,
        overrides=overrides,
        flags=OUTCOME_CONFIG.flags,
        length_unit="chars",
        flag_scope=flag_scope,
    )
    return counts.fit([])


def test_gated_exam_questions_differ_only_in_length_in_sklearn_and_onnx() -> None:
    """Catches the code-symbols flag firing on exam questions (3.1's gating leaves it on): with the
    flag gated, two exam questions' feature rows differ in the length column alone, and the ONNX
    graph computes the same rows."""
    import onnxruntime
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType

    from classifier.training.features import register_converters
    from classifier.training.train import TARGET_OPSET

    register_converters()
    texts = [model_text(_exam(q)) for q in SYMBOLIC + PLAIN]
    flag = 1 + len(DOMAIN_GROUPS) + 1  # [length, family one-hot, choices flag, code-symbols flag]
    old = np.asarray(_family_counts(DOMAIN_GROUPS).transform(texts))
    assert old[: len(SYMBOLIC), flag].tolist() == [1.0] * len(SYMBOLIC)  # the 3.1 mechanism
    assert old[len(SYMBOLIC) :, flag].tolist() == [0.0] * len(PLAIN)

    gated = _family_counts((*DOMAIN_GROUPS, *FLAG_GROUPS_GATED))
    rows = np.asarray(gated.transform(texts))
    assert (rows[:, 1:] == rows[0, 1:]).all()  # every column but the length is the same
    assert rows[0, 1 + len(DOMAIN_GROUPS)] == 1.0  # the choices flag is what stays on
    np.testing.assert_allclose(rows[:, 0], np.log1p([len(t) for t in texts]), rtol=1e-6)

    graph = convert_sklearn(
        gated, initial_types=[("text", StringTensorType([None, 1]))], target_opset=TARGET_OPSET
    )
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(None, {"text": np.array([[t] for t in texts], dtype=object)})[0]
    np.testing.assert_allclose(out, rows, rtol=1e-6, atol=1e-6)


def _outcome_rows() -> list[dict[str, object]]:
    """Exam questions whose code symbols go with the strong model's gain (so a model that sees the
    flag learns a positive weight for it) and whose gain grows with length, plus free-form rows."""
    rows: list[dict[str, object]] = []
    for i in range(60):
        words = " ".join(["word"] * (3 + i % 20))
        symbolic = i % 3 == 0
        question = f"Which {words} applies (see {i}/{i + 1}) $?" if symbolic else f"Which {words} applies?"
        gain = symbolic or i % 20 >= 12
        rows.append({"prompt": _exam(question), "weak": 0 if gain else 1, "strong": 1})
    for i in range(30):
        rows.append({"prompt": f"Write a short poem number {i} about rain.", "weak": 1, "strong": 1})
        rows.append({"prompt": f"Solve {i} + {i} * 3 step by step and explain.", "weak": 0, "strong": 1})
    return rows


def test_gated_score_never_ranks_a_shorter_exam_question_above_a_longer_one() -> None:
    """Catches a within-family score that is not monotone in length: fitted on the same outcomes,
    the 3.1 features put a short symbol-laden exam question above longer plain ones; the gated
    features rank every exam question by its length (to a tolerance of 1e-9)."""
    rows = _outcome_rows()
    probes = [_exam(q) for q in SYMBOLIC + PLAIN]
    order = np.argsort([len(model_text(p)) for p in probes], kind="stable")

    gated = outcome_proba(fit_outcomes(rows, GATED_CONFIG), probes)[order]
    assert (np.diff(gated) >= -1e-9).all(), gated
    assert gated[-1] > gated[0]  # the length term is there, not flattened

    # 3.1's features, named explicitly so the check outlives a change of the shipped default.
    flagged = outcome_proba(fit_outcomes(rows, OutcomeConfig(gate_flags=False)), probes)[order]
    assert (np.diff(flagged) < -1e-9).any(), flagged  # the old behaviour this guards against


@pytest.mark.shared_data(MMLU)
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="issue 56 open: the shipped score (4.0) routes held-out mmlu_other at 0.579 vs prompt "
    "length 0.609",
)
def test_shipped_score_is_not_below_length_in_any_heldout_mmlu_category(shipped: object) -> None:
    """The acceptance check on the shipped artifact: per MMLU category of the held-out subjects,
    APGR >= prompt length - 0.01. Strict xfail while it fails, so shipping a fix makes it XPASS
    (and this marker must go)."""
    from classifier.validation.families import LENGTH, family_table
    from classifier.validation.outcomes import heldout_subjects, load_outcomes

    mmlu = load_outcomes(MMLU)
    held = set(heldout_subjects([r["subject"] for r in mmlu]))
    rows = [r for r in mmlu if r["subject"] in held]
    values = [s.value for s in shipped.score_batch([r["prompt"] for r in rows])]  # type: ignore[attr-defined]
    table = family_table(rows, {"value": values}, draws=20, pooled=False)
    short = {f: (e["value"]["apgr"], e[LENGTH]["apgr"]) for f, e in table.items() if e.get("judged")}
    assert len(short) == 4
    assert all(v >= length - 0.01 for v, length in short.values()), short


# Maths word problems written for this test (not from any data set): reasoning words ("each",
# "if", "after", "before", "older"), dollar signs, slashes and brackets that 3.1's argmax family
# or code-symbols flag reacted to, at lengths from 60 to 400 characters.
WORD_PROBLEMS = [
    "Sam is 4 years older than Ann. If Ann is 9, how old is Sam?",
    "Each of 3 boxes holds 12 pens. How many pens are there after 5 more are added?",
    "A book costs $12 and a pen costs $3 (before tax). If Mia buys 2 books, what is the total?",
    "Before noon a baker sells 24 rolls, and after noon half as many. If each roll is $2, "
    "how much does the baker earn in a day, in dollars?",
    "Tom reads 20 pages each day. His sister reads 1/4 more than him each day. If the book has "
    "300 pages, after how many days will his sister finish it, and how many pages are left for Tom?",
    "A store had 120 shirts. Each morning it sold 1/3 of what was left (rounded down) and each "
    "evening it got 10 more from the warehouse. If this went on for 3 days, and every shirt was "
    "$15 [$12 after the sale], how many shirts were there after the third evening, and what was "
    "the value of the stock then if every shirt left was sold at the sale price?",
]


def test_word_problems_rank_by_length_in_the_features_and_the_shipped_score(shipped: object) -> None:
    """Catches a word problem leaving the maths family or picking up the code-symbols flag (3.1:
    "each"/"if"/"older" won the argmax for reasoning, and "$", "/" and "[" set the flag), in
    scikit-learn's features and in the shipped graph: the feature rows differ in the length
    column alone, and the shipped score is strictly increasing in characters."""
    feats = _family_counts(DOMAIN_GROUPS, PREVIOUS_CONFIG.overrides, PREVIOUS_CONFIG.flag_scope)  # 3.2
    texts = [model_text(p) for p in WORD_PROBLEMS]
    rows = np.asarray(feats.transform(texts))
    names = list(feats.get_feature_names_out())
    assert (rows[:, 1:] == rows[0, 1:]).all(), rows[:, 1:]
    assert rows[0, names.index("family_math_words")] == 1.0
    old = _family_counts(DOMAIN_GROUPS)  # 3.1's features
    assert not (np.asarray(old.transform(texts))[:, 1:] == rows[0, 1:]).all()  # 3.1 split them

    order = np.argsort([len(t) for t in texts])
    assert order.tolist() == list(range(len(texts)))  # written shortest first
    values = np.array([s.value for s in shipped.score_batch(WORD_PROBLEMS)])  # type: ignore[attr-defined]
    assert (np.diff(values) > 0).all(), values


@pytest.mark.shared_data(DIFFICULTY)
def test_shipped_score_ranks_gsm8k_problems_by_length(shipped: object) -> None:
    """The acceptance mechanism on real prompts: inside difficulty_7b's GSM8K word problems the
    shipped score's rank correlation with prompt length is at least 0.95 (3.1: 0.68)."""
    import gzip
    import json

    from scipy.stats import spearmanr

    with gzip.open(DIFFICULTY, "rt", encoding="utf-8") as f:
        prompts = [r["prompt"] for r in map(json.loads, f) if r["source"] == "gsm8k-train"]
    assert len(prompts) >= 500
    values = [s.value for s in shipped.score_batch(prompts)]  # type: ignore[attr-defined]
    rho = spearmanr(values, [len(p) for p in prompts])[0]
    assert rho >= 0.95, rho
