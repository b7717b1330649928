"""The outcome-trained routing score: training, export, the shipped artifact (classifier/outcome_train.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from classifier import ComplexityClassifier
from classifier.data import TRAIN_PATH, load_jsonl, write_jsonl
from classifier.inference import ARTIFACT_DIR
from classifier.training.outcome_train import (
    PROXY_PATH,
    fit_outcomes,
    outcome_proba,
    tier_masses,
    train_outcomes,
)
from classifier.validation.evaluate import evaluate_outcomes
from classifier.validation.outcomes import load_outcomes

ROOT = Path(__file__).resolve().parents[3]
MMLU = ROOT.parent / "shared/data/routing/mmlu_outcomes.jsonl.gz"
DIFFICULTY = ROOT.parent / "shared/data/routing/difficulty_7b.jsonl.gz"
needs_mmlu = pytest.mark.shared_data(MMLU)  # skipped without it, a failure under CI=true (conftest.py)

_DIGIT = re.compile(r"\d")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Corpus prompts with a learnable outcome: the weak model fails where digits appear.

    Eight made-up subjects, so the subject split has something to hold out.
    """
    rows = []
    for i, r in enumerate(load_jsonl(TRAIN_PATH)[::4]):
        fails = bool(_DIGIT.search(r["prompt"])) or r["label"] == "large"
        rows.append({"prompt": r["prompt"], "weak": 0 if fails else 1, "strong": 1, "subject": f"s{i % 8}"})
    path = tmp_path_factory.mktemp("o") / "synthetic.jsonl"
    write_jsonl(path, rows)
    return path


@pytest.fixture(scope="module")
def trained(synthetic: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("model")
    return out, train_outcomes(synthetic, out, extra_paths=())


def test_value_is_the_learned_probability(trained: tuple[Path, dict], synthetic: Path) -> None:
    out, meta = trained
    clf = ComplexityClassifier.load(out)
    rows = load_outcomes(synthetic)[:200]
    prompts = [r["prompt"] for r in rows]
    scores = clf.score_batch(prompts)
    values = np.array([s.value for s in scores])
    masses = np.array([[s.probabilities[t] for t in ("small", "medium", "large")] for s in scores])
    # The tier head is Binomial(2, value): its expected tier weight is value itself.
    np.testing.assert_allclose(masses, tier_masses(values), atol=1e-6)
    assert meta["onnx"]["max_abs_drift_vs_sklearn"] < 1e-4
    # It learned the rule: prompts with digits score higher on average.
    has_digit = np.array([bool(_DIGIT.search(p)) for p in prompts])
    assert values[has_digit].mean() > values[~has_digit].mean() + 0.1


def test_graph_matches_scikit_learn(synthetic: Path) -> None:
    from classifier.training.outcome_onnx import export_outcome_onnx, onnx_masses

    rows = load_outcomes(synthetic)
    pipeline = fit_outcomes(rows)
    model = export_outcome_onnx(pipeline)
    probes = (
        [
            "",
            "hi",
            "a" * 6000,
            "東京?",
            "def f(x):\n    return x ** 2  # 3 + 4 = 7",
            "Solve 3 + 4 = x.\nA. 7\nB. 8\nC. 1\nD. 12\nAnswer:",  # gated cues
        ]
        + [r["prompt"] for r in rows[:50]]
    )
    np.testing.assert_allclose(
        onnx_masses(model, probes), tier_masses(outcome_proba(pipeline, probes)), atol=1e-5
    )
    ops = [n.op_type for n in model.graph.node]
    # The unused label output was pruned (its ArgMax over the two classes); the one ArgMax left
    # is FamilyCounts' dominant domain.
    assert [o.name for o in model.graph.output] == ["probabilities"]
    assert ops.count("ArgMax") == 1
    # Words (the counts) and characters (the length column): one Tokenizer each.
    tokenizers = [n for n in model.graph.node if n.op_type == "Tokenizer"]
    patterns = [a.s.decode() for n in tokenizers for a in n.attribute if a.name == "tokenexp"]
    assert len(patterns) == 2 and "." in patterns


def test_length_column_counts_characters_not_tokens() -> None:
    """Catches a length column in word tokens (3.0) or in UTF-8 bytes: the shipped score's length
    is the prompt-length baseline's unit, characters of the model text, in the graph as well."""
    import onnxruntime
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType

    from classifier.text import OUTCOME_GROUPS, model_text
    from classifier.training.features import FamilyCounts, register_converters
    from classifier.training.outcome_train import CODE_OVERRIDE, DOMAIN_GROUPS, OUTCOME_CONFIG
    from classifier.training.train import TARGET_OPSET

    assert OUTCOME_CONFIG.length_unit == "chars"
    register_converters()
    texts = ["東京は大きい?", "one two three four five", "x" * 40]
    counts = FamilyCounts(
        OUTCOME_GROUPS, domains=DOMAIN_GROUPS, overrides=(CODE_OVERRIDE,), length_unit="chars"
    )
    counts.fit([])
    expected = np.log1p([len(model_text(t)) for t in texts])  # 7, 23, 40 characters
    np.testing.assert_allclose(counts.transform([model_text(t) for t in texts])[:, 0], expected, rtol=1e-6)
    text = [("text", StringTensorType([None, 1]))]
    graph = convert_sklearn(counts, initial_types=text, target_opset=TARGET_OPSET)
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(None, {"text": np.array([[model_text(t)] for t in texts], dtype=object)})[0]
    np.testing.assert_allclose(out[:, 0], expected, rtol=1e-6)


def test_domain_cues_are_gated_off_on_multiple_choice_questions() -> None:
    from classifier.text import OUTCOME_GROUPS, model_text
    from classifier.training.features import TokenCounts
    from classifier.training.outcome_train import DOMAIN_GROUPS

    names = [n for n, _ in OUTCOME_GROUPS]
    counts = TokenCounts(OUTCOME_GROUPS, gate="choices", gated=DOMAIN_GROUPS, gate_at=3).fit([])
    ask = "Write a python function to solve the equation x + 2 = 5."
    exam_text = ask + "\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"
    free, exam = counts.transform([model_text(ask), model_text(exam_text)])
    for group in DOMAIN_GROUPS:
        if group in ("writing", "code", "math_words", "math_symbols"):
            assert free[names.index(group)] > 0, group
        assert exam[names.index(group)] == 0, group
    assert exam[names.index("tokens")] > free[names.index("tokens")]  # ungated counts stay
    # A bare "Answer:" (few-shot maths) or one lettered aside is not a multiple-choice question.
    for text in (ask + "\nAnswer:", ask + " Is it plan a. or plan b.?"):
        (row,) = counts.transform([model_text(text)])
        assert row[names.index("code")] > 0, text
    with pytest.raises(ValueError, match="unknown count groups"):
        TokenCounts(OUTCOME_GROUPS, gate="nope").fit([]).transform(["x"])


def test_subjects_are_held_out_and_reported(trained: tuple[Path, dict], synthetic: Path) -> None:
    _, meta = trained
    held = meta["metrics"]["heldout_subjects"]
    assert len(held) == 2  # a quarter of the 8 subjects
    rows = load_outcomes(synthetic)
    assert meta["metrics"]["n"] == sum(r["subject"] in held for r in rows)
    assert meta["training_data"]["n"] == len(rows) - meta["metrics"]["n"]
    assert meta["metrics"]["apgr"] > 0.6  # the digit rule transfers to unseen subjects


def test_retraining_is_byte_for_byte(synthetic: Path, trained: tuple[Path, dict], tmp_path: Path) -> None:
    train_outcomes(synthetic, tmp_path, extra_paths=())
    first = trained[0]
    assert (tmp_path / "model.onnx").read_bytes() == (first / "model.onnx").read_bytes()
    assert (tmp_path / "metadata.json").read_bytes() == (first / "metadata.json").read_bytes()


def test_rejects_data_without_both_outcomes(tmp_path: Path) -> None:
    path = tmp_path / "flat.jsonl"
    write_jsonl(path, [{"prompt": f"p{i}", "weak": 1, "strong": 1} for i in range(10)])
    with pytest.raises(ValueError, match="strong tier helped"):
        train_outcomes(path, tmp_path / "out", extra_paths=())


def test_family_features_match_the_graph_and_keep_length_inside_a_family() -> None:
    """FamilyCounts: one-hot family + length; the ONNX converter must compute exactly what
    transform() does (a wrong tie-break, override order, gate or flag scope would send a family to
    another prior), and inside one family only the length column may vary (the bug: log counts of
    domain words that move inside a family and drown the length signal; a word problem's "each"
    and "if" sending it to the reasoning family, its dollar signs setting the code-symbols flag)."""
    import onnxruntime as ort

    from classifier.text import OUTCOME_GROUPS, model_text
    from classifier.training.features import FamilyCounts, register_converters
    from classifier.training.outcome_train import CODE_OVERRIDE, DOMAIN_GROUPS, FAMILY_FLAGS, MATHS_OVERRIDE
    from classifier.training.train import model_rows

    register_converters()
    feats = FamilyCounts(
        OUTCOME_GROUPS,
        gate="choices",
        gated=DOMAIN_GROUPS,
        gate_at=3,
        domains=DOMAIN_GROUPS,
        overrides=(CODE_OVERRIDE, MATHS_OVERRIDE),
        flags=FAMILY_FLAGS,
        flag_scope=("choices", 3),
    ).fit([])
    texts = [
        "",
        "hi",
        "Write a poem about rain.",
        "A shop sells 3 pens for $2. How much do 12 pens cost?",
        "A shop sells 3 pens for $2. How much do 12 pens cost if each pen costs twice as much on Monday?",
        'def f(x):\n    """Return the sum of the digits of x, how many times."""\n    return {x: [1]}',
        "Which is right?\nA. a sum\nB. a total\nC. an average\nD. none\nAnswer:",
        "日本語の質問です",
        # Reasoning words outnumber maths words: the maths override, not the argmax, decides.
        "If each of the 4 friends gives after lunch and before dinner 3 apples, how many are there?",
        "Which costs {more} (in $) or [less]?\nA. $1\nB. $2\nC. $3\nD. $4\nAnswer:",
        "const add = (x, y) => {\n  /* Return the sum of 2 and 3, twice */ return x + y; }",
    ]
    names = list(feats.get_feature_names_out())
    ours = feats.transform([model_text(t) for t in texts])
    # Reference: the family by hand from the Python twin of the counts.
    fam = [
        names[1 + int(np.argmax(row[1 : 1 + len(DOMAIN_GROUPS)]))]
        if row[1 : 1 + len(DOMAIN_GROUPS)].any()
        else None
        for row in ours
    ]
    assert fam[2] == "family_writing" and fam[3] == fam[4] == "family_math_words"
    assert fam[5] == "family_code"  # the override: maths words in a docstring do not make it maths
    assert fam[6] is None and ours[6][names.index("flag_choices_3")] == 1.0  # gated exam question
    assert fam[0] is None and ours[0][0] == 0.0
    # Two maths word problems differ only in length: the dollar signs set no flag outside an exam.
    assert (ours[3][1:] == ours[4][1:]).all() and ours[4][0] > ours[3][0]
    assert ours[3][names.index("flag_code_symbols_3")] == 0.0
    assert fam[8] == "family_math_words"
    assert ours[9][names.index("flag_code_symbols_3")] == 1.0  # on an exam question the flag counts
    assert fam[10] == "family_code"  # code before maths: the first firing override wins

    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType

    model = convert_sklearn(
        feats, initial_types=[("text", StringTensorType([None, 1]))], target_opset={"": 19, "ai.onnx.ml": 3}
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = session.run(None, {"text": np.array([[r[0]] for r in model_rows(texts)], dtype=object)})[0]
    np.testing.assert_allclose(graph, ours, atol=1e-6)


def test_pass_rates_train_as_soft_targets() -> None:
    """Pass rates (0.3 / 0.9) are a gain probability strong * (1 - weak), not a coin flip on
    strong > weak: a row where both models are equally good still holds some gain mass, and 0/1
    outcomes give exactly the old 0/1 target."""
    from classifier.training.outcome_train import outcome_targets

    rows = [
        {"prompt": "a", "weak": 0.3, "strong": 0.9},
        {"prompt": "b", "weak": 0.5, "strong": 0.5},
        {"prompt": "c", "weak": 1.0, "strong": 0.0},
        {"prompt": "d", "weak": 0.0, "strong": 1.0},
    ]
    np.testing.assert_allclose(outcome_targets(rows), [0.9 * 0.7, 0.25, 0.0, 1.0])


def test_proxy_corpus_is_small_balanced_and_free_form() -> None:
    rows = load_outcomes(PROXY_PATH)
    gains = [r["strong"] > r["weak"] for r in rows]
    assert 80 <= len(rows) <= 400
    assert 0.3 < sum(gains) / len(rows) < 0.7
    assert not any("\nA." in r["prompt"] and "Answer:" in r["prompt"] for r in rows)  # no MMLU format


def test_shipped_artifact_is_the_outcome_score() -> None:
    # Its latency is a benchmark's figure (benchmarks/classifier.py: p99 per score), not a timed
    # assertion here: on a shared CI host a neighbour's load would fail it.
    model = onnx.load(str(ARTIFACT_DIR / "model.onnx"))
    assert {p.key: p.value for p in model.metadata_props}["score"] == "outcome"
    clf = ComplexityClassifier.load()
    short, long = clf.score("hi"), clf.score("Prove that there are infinitely many primes. " * 20)
    assert 0.0 <= short.value <= 1.0 and 0.0 <= long.value <= 1.0


@needs_mmlu
@pytest.mark.shared_data(DIFFICULTY)
def test_shipped_artifact_reproduces_from_the_command_line(tmp_path: Path) -> None:
    from classifier.cli import main

    argv = ["train", "--outcomes", str(MMLU), "--difficulty", str(DIFFICULTY), "--out", str(tmp_path)]
    assert main(argv) == 0
    fresh = json.loads((tmp_path / "metadata.json").read_text())
    shipped = json.loads((ARTIFACT_DIR / "metadata.json").read_text())
    if fresh["numerics"] == shipped["numerics"]:  # a host of the kind it was trained on: to the bit
        assert (tmp_path / "model.onnx").read_bytes() == (ARTIFACT_DIR / "model.onnx").read_bytes()
        assert fresh["metrics"] == shipped["metrics"]
        return
    # Another SIMD kind sums in another order, so the fit's last bits differ (an AVX2 host moved
    # cpt_50 by 0.0016); a wrong seed, split, feature set or data file moves these by far more.
    assert fresh["metrics"]["n"] == shipped["metrics"]["n"]
    assert fresh["metrics"]["heldout_subjects"] == shipped["metrics"]["heldout_subjects"]
    for key in ("apgr", "cpt_50", "cpt_80", "apgr_prompt_length"):
        assert fresh["metrics"][key] == pytest.approx(shipped["metrics"][key], abs=0.01), key


@needs_mmlu
def test_shipped_score_on_heldout_subjects(tmp_path: Path) -> None:
    result = evaluate_outcomes(MMLU, png=tmp_path / "curve.png", latency_prompts=50)
    assert (
        result["subjects"]
        == json.loads((ARTIFACT_DIR / "metadata.json").read_text())["metrics"]["heldout_subjects"]
    )
    assert result["apgr"] >= 0.60  # the acceptance bar
    assert result["apgr"] > result["baselines"]["random"]["apgr"] + 0.1
    assert 0.0 < result["cpt_50"] < result["cpt_80"] < 1.0
    assert (tmp_path / "curve.png").stat().st_size > 1000
