"""The outcome-trained routing score: learn where the cheap tier falls short, export one ONNX graph.

``train_outcomes()`` fits a logistic regression of ``gain = strong succeeded where weak did not``
(the only case in which sending a prompt up buys quality) on outcome rows
(:mod:`classifier.validation.outcomes`); with pass rates (or judge scores) in [0, 1] the target is the
probability of that event, ``strong * (1 - weak)``, fitted as two weighted rows. Features
(``OutcomeConfig.features``):

* ``"family"`` (shipped): :class:`~classifier.training.features.FamilyCounts`: log prompt length, the
  task family (the dominant domain cue: maths, code, reasoning, writing, role-play, chat; none on
  multiple-choice exam questions; code whenever code symbols and a code word, else maths whenever
  numbers and a maths word) one-hot, and two flags on exam questions (lettered options, code
  symbols). Inside a family only the length varies, so the score keeps the length signal there
  and the family columns learn the between-family priors;
* ``"counts"`` (the previous artifact): :class:`~classifier.training.features.TokenCounts` over
  :data:`~classifier.text.OUTCOME_GROUPS`, log counts of length, structure and domain cues;
* optionally a word TF-IDF (unigrams), strongly regularized.

Besides the MMLU outcomes (Mixtral vs GPT-4) and the proxy corpus, training reads
``difficulty_7b`` (maths word problems, pre-algebra, Python and JavaScript with seven 7-8B models'
pass rates) under ``OutcomeConfig.difficulty_pair``: a second model family, which sets the maths
and code priors from measured outcomes instead of hand-written proxies alone.

The graph (:mod:`classifier.training.outcome_onnx`) outputs Binomial(2, P(gain)) tier masses, so
:attr:`ComplexityScore.value` is the learned probability itself.

Everything is deterministic: the subject split is by hash, the solver is deterministic and the
sample order is the file's, so ``tiered-router classifier train --outcomes ...`` reproduces the
shipped artifact byte for byte (a test checks the graph; README shows the command).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from classifier.data import DATA_DIR, LABELS
from classifier.text import OUTCOME_GROUPS, WORD_TOKEN_PATTERN
from classifier.training.outcome_onnx import export_outcome_onnx, onnx_masses, tier_masses
from classifier.training.priors import LATEX_OVERRIDE
from classifier.validation.outcomes import (
    HELDOUT_SUBJECT_FRACTION,
    OutcomeRow,
    heldout_subjects,
    load_outcomes,
    routing_metrics,
)

__all__ = [
    "DIFFICULTY_7B",
    "DIFFICULTY_PAIR",
    "DROPPED_SUBJECTS",
    "GATED_CONFIG",
    "MATHS_OVERRIDE",
    "MMLU_OUTCOMES",
    "OUTCOME_CONFIG",
    "OUTCOME_VERSION",
    "PREVIOUS_CONFIG",
    "PROXY_PATH",
    "TOKENS_CONFIG",
    "OutcomeConfig",
    "fit_outcomes",
    "lofo_fitter",
    "outcome_proba",
    "outcome_targets",
    "tier_masses",
    "train_outcomes",
]

OUTCOME_VERSION = "4.0.0"
# Where the outcome data lives in this workspace (read at training time, never copied here).
SHARED_ROUTING = Path(__file__).resolve().parents[3] / "shared/data/routing"
MMLU_OUTCOMES = SHARED_ROUTING / "mmlu_outcomes.jsonl.gz"
DIFFICULTY_7B = SHARED_ROUTING / "difficulty_7b.jsonl.gz"
# The 7-8B pair the shipped score trains on: the base model against the strongest general
# fine-tune, whose gain is positive in every family (maths word problems +0.40, pre-algebra
# +0.15, Python +0.17, JavaScript +0.24).
DIFFICULTY_PAIR = ("mistralai/Mistral-7B-v0.1", "cognitivecomputations/dolphin-2.9-llama3-8b")
# The hand-written outcome-proxy corpus (classifier/README.md, "Routing score"): free-form
# prompts of the kinds MMLU lacks (writing, role-play, chat, maths word problems, code), with
# outcomes set from their category's published weak/strong gap.
PROXY_PATH = DATA_DIR / "outcome_proxy.jsonl"
# RouteLLM's MMLU file has GPT-4 at 3 % on high_school_mathematics (chance is 25 %, Mixtral 32 %):
# its answers were not extracted, not wrong. Training on it would teach "maths: weak is better".
DROPPED_SUBJECTS: tuple[str, ...] = ("high_school_mathematics",)
# Topic cues of free-form requests. On MMLU's multiple-choice questions they point the wrong way
# (the strong model gains most on moral scenarios and law, least on chemistry and statistics),
# while on open requests the strong model gains most on maths, reasoning and code (MT-Bench):
# gated on "no lettered options", MMLU rows leave them at 0 and only free-form data sets them.
DOMAIN_GROUPS: tuple[str, ...] = (
    "math_symbols",
    "math_words",
    "code",
    "reasoning",
    "writing",
    "roleplay",
    "chat",
)
# FamilyCounts: code whenever the prompt has code symbols and a code word (a docstring's maths
# words must not make a coding task "maths"); flags for exam questions and code-looking prompts.
CODE_OVERRIDE = ("code", (("code_symbols", 3), ("code", 1)))
# Maths whenever the prompt has numbers and maths words, whatever its reasoning or chat words say
# (a word problem's "each", "if" and "after" sent 12 % of GSM8K to the reasoning family).
MATHS_OVERRIDE = ("math_words", (("numbers", 2), ("math_words", 1)))
FAMILY_FLAGS = (("choices", 3), ("code_symbols", 3))
# Flag groups gated off on multiple-choice questions with the domain cues (OutcomeConfig.gate_flags).
FLAG_GROUPS_GATED: tuple[str, ...] = ("code_symbols",)


@dataclass(frozen=True)
class OutcomeConfig:
    name: str = "lr-family-stable"
    features: str = "family"
    """``"prior"``: category prior + bounded within-category length (priors.PriorLength);
    ``"family"``: length + task family (FamilyCounts); ``"counts"``: log counts (TokenCounts)."""
    c: float = 0.3
    """Inverse L2 strength of the logistic regression."""
    word_max_features: int = 0
    """Word TF-IDF vocabulary (0: off). Measured not to transfer across subjects; see README."""
    proxy_weight: float = 1.0
    """Sample weight of each proxy-corpus row (an MMLU row weighs 1)."""
    heldout_fraction: float = HELDOUT_SUBJECT_FRACTION
    """Share of subjects kept out of training for evaluation (0: train on every subject)."""
    gate_domain: bool = True
    """Domain cues count only in prompts that are not multiple-choice exam questions."""
    scale: bool = False
    """Standardize the counts. Off: gated cues are 0 on most training rows, so their standard
    deviation is tiny and standardizing would blow them up on every free-form prompt."""
    difficulty_pair: tuple[str, str] = DIFFICULTY_PAIR
    """(weak, strong) models of pass-rate rows (difficulty_7b) in training."""
    difficulty_weight: float = 1.0
    """Sample weight of each pass-rate row."""
    flags: tuple[tuple[str, int], ...] = FAMILY_FLAGS
    """FamilyCounts' 0/1 columns ``(group, at least)``."""
    gate_flags: bool = False
    """Gate the code-symbols count (and its flag) off on exam questions too (:data:`GATED_CONFIG`):
    their only varying column is then the length (classifier/README.md, "Gated code-symbols flag")."""
    bound: float = 1.0
    """``"prior"`` features: the within-category length term's bound ``k`` (PriorLength)."""
    per_category: bool = False
    """``"prior"`` features: centre the length term on each category's median (PriorLength)."""
    length_unit: str = "chars"
    """FamilyCounts' length column: characters of the model text (the ``prompt length`` baseline's
    unit) or word tokens (the previous artifact). Characters route MMLU's held-out STEM subjects
    and Python at or above length, where token counts fell below it (benchmarks/routing_quality)."""
    overrides: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (CODE_OVERRIDE, MATHS_OVERRIDE)
    """FamilyCounts' family overrides, the first firing one winning. 3.1 had the code override
    alone: 27 % of difficulty_7b's GSM8K word problems left the maths family (12 % to reasoning),
    and the family priors' jumps ranked them against their length (Spearman 0.68 with length)."""
    flag_scope: tuple[str, int] | None = ("choices", 3)
    """Flags count only where this ``(group, at least)`` holds: the code-symbols flag on exam
    questions only (FamilyCounts.flag_scope). In 3.1 (None) it also fired on the dollar signs of
    10 % of GSM8K's word problems and 58 % of pre-algebra's."""


# 3.2: length + task family (the previous artifact), kept for side-by-side runs; 3.1 and 3.0 before it.
PREVIOUS_CONFIG = OutcomeConfig()
# 4.0 (shipped, issue 56): category prior + bounded, centred within-category length, LaTeX as maths
# of its own (classifier/training/priors.py).
OUTCOME_CONFIG = OutcomeConfig(
    name="lr-prior-within", features="prior", overrides=(CODE_OVERRIDE, LATEX_OVERRIDE, MATHS_OVERRIDE)
)
V31_CONFIG = OutcomeConfig(name="lr-family-length", overrides=(CODE_OVERRIDE,), flag_scope=None)
TOKENS_CONFIG = dataclasses.replace(V31_CONFIG, name="lr-family-tokens", length_unit="tokens")
# Issue 32's candidate, measured beside the shipped score: 3.2 with the code-symbols flag gated off
# on exam questions too (classifier/README.md, "Routing score", has the per-family table).
GATED_CONFIG = OutcomeConfig(name="lr-family-stable-gated", gate_flags=True)
COUNTS_CONFIG = OutcomeConfig(name="lr-outcome-groups", features="counts")


def _features(config: OutcomeConfig) -> Any:
    from skl2onnx.sklapi import TraceableTfidfVectorizer
    from sklearn.compose import ColumnTransformer
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from classifier.training.features import FamilyCounts, TokenCounts
    from classifier.training.priors import CATEGORY_DOMAINS, CATEGORY_GROUPS, PriorLength

    domains = CATEGORY_DOMAINS if config.features == "prior" else DOMAIN_GROUPS
    gated = (*domains, *FLAG_GROUPS_GATED) if config.gate_flags else domains
    gating: dict[str, Any] = {"gate": "choices", "gated": gated, "gate_at": 3} if config.gate_domain else {}
    family: dict[str, Any] = {
        "domains": domains,
        "overrides": config.overrides,
        "flags": config.flags,
        "length_unit": config.length_unit,
        "flag_scope": config.flag_scope,
        **gating,
    }
    if config.features == "prior":
        counts: Any = PriorLength(
            CATEGORY_GROUPS, bound=config.bound, per_category=config.per_category, **family
        )
    elif config.features == "family":
        counts = FamilyCounts(OUTCOME_GROUPS, **family)
    elif config.features == "counts":
        counts = TokenCounts(OUTCOME_GROUPS, **gating)
    else:
        raise ValueError(f"unknown features {config.features!r} (family or counts)")
    steps: list[tuple[str, Any]] = [("tokens", counts)]
    if config.scale:
        steps.append(("scale", StandardScaler()))
    parts: list[tuple[str, Any, int]] = [("counts", Pipeline(steps), 0)]
    if config.word_max_features > 0:
        words = TraceableTfidfVectorizer(
            token_pattern=WORD_TOKEN_PATTERN,
            ngram_range=(1, 1),
            max_features=config.word_max_features,
            min_df=5,
            binary=True,
            lowercase=False,
            dtype=np.float32,
        )
        parts.append(("word", words, 0))
    return ColumnTransformer(parts, sparse_threshold=1.0)


def outcome_targets(rows: Sequence[OutcomeRow]) -> np.ndarray:
    """P(strong succeeds where weak fails) per row: ``strong * (1 - weak)`` on scores clipped to
    [0, 1] (exactly ``strong > weak`` on 0/1 outcomes; on pass rates, the chance that one sample
    of each model shows the gain)."""
    strong = np.clip([r["strong"] for r in rows], 0.0, 1.0)
    weak = np.clip([r["weak"] for r in rows], 0.0, 1.0)
    return np.asarray(strong * (1.0 - weak), dtype=np.float64)


def fit_outcomes(
    rows: Sequence[OutcomeRow], config: OutcomeConfig = OUTCOME_CONFIG, weights: Sequence[float] | None = None
) -> Any:
    """A fitted Pipeline(features, LogisticRegression) over model_rows() input; classes [0, 1]."""
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    from classifier.training.priors import register_prior_converter
    from classifier.training.train import model_rows

    target = outcome_targets(rows)
    if not (target.max() > 0.0 and target.min() < 1.0):
        raise ValueError(
            "outcome rows must include prompts where the strong tier helped and where it did not"
        )
    register_prior_converter()
    features = _features(config)
    x = features.fit_transform(model_rows([r["prompt"] for r in rows]))
    base = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64)
    # Each row twice: as a gain with weight w * t and as no gain with weight w * (1 - t).
    w2 = np.concatenate([base * target, base * (1.0 - target)])
    keep = np.flatnonzero(w2 > 0.0)
    x2 = sparse.vstack([x, x]).tocsr() if sparse.issparse(x) else np.vstack([x, x])
    y2 = np.concatenate([np.ones(len(rows), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)])
    # lbfgs is deterministic for a given input; tol tight so retraining reproduces the weights.
    linear = LogisticRegression(C=config.c, max_iter=5000, tol=1e-8)
    linear.fit(x2[keep], y2[keep], sample_weight=w2[keep])
    return Pipeline([("features", features), ("classifier", linear)])


def outcome_proba(pipeline: Any, prompts: Sequence[str]) -> np.ndarray:
    """scikit-learn P(gain) per prompt (the reference the ONNX graph must match)."""
    from classifier.training.train import model_rows

    return np.asarray(pipeline.predict_proba(model_rows(prompts)))[:, 1]


def training_rows(
    outcomes_path: str | Path,
    config: OutcomeConfig = OUTCOME_CONFIG,
    extra_paths: Sequence[str | Path] = (PROXY_PATH,),
    more_outcomes: Sequence[str | Path] = (),
    difficulty_paths: Sequence[str | Path] = (),
    exclude_families: Sequence[str] = (),
) -> tuple[list[OutcomeRow], list[float], list[str], list[str]]:
    """``(rows, weights, heldout_subjects, dropped_subjects)`` for :func:`fit_outcomes`.

    ``more_outcomes`` (shadow and feedback logs: real outcomes, weight 1) are read together with
    ``outcomes_path``, so lines about one answer merge by id; ``extra_paths`` (the proxy corpus)
    weigh ``config.proxy_weight`` each; ``difficulty_paths`` (pass-rate rows, read under
    ``config.difficulty_pair``) ``config.difficulty_weight``. Rows of ``exclude_families`` are
    left out (leave-one-family-out validation).
    """
    rows = load_outcomes([outcomes_path, *more_outcomes])
    subjects = [r["subject"] for r in rows if "subject" in r]
    held = heldout_subjects(subjects, config.heldout_fraction) if config.heldout_fraction > 0 else []
    dropped = [s for s in DROPPED_SUBJECTS if s in set(subjects)]
    skip = set(held) | set(dropped)
    train = [r for r in rows if r.get("subject") not in skip]
    weights = [1.0] * len(train)
    for path in extra_paths:
        extra = load_outcomes(path)
        train += extra
        weights += [config.proxy_weight] * len(extra)
    for path in difficulty_paths:
        rated = load_outcomes(path, pair=config.difficulty_pair)
        train += rated
        weights += [config.difficulty_weight] * len(rated)
    if exclude_families:
        out = set(exclude_families)
        kept = [i for i, r in enumerate(train) if r["family"] not in out]
        train, weights = [train[i] for i in kept], [weights[i] for i in kept]
    return train, weights, held, dropped


PARITY_PROBES = (
    "",
    "hi",
    "Write a poem about rain.",
    "A shop sells 3 pens for $2. How much do 12 pens cost?",
    "def f(x):\n    return {x: [1, 2]}",
    "日本語の質問です",
    "a" * 5000,
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_outcomes(
    outcomes_path: str | Path,
    out_dir: str | Path,
    config: OutcomeConfig = OUTCOME_CONFIG,
    extra_paths: Sequence[str | Path] = (PROXY_PATH,),
    more_outcomes: Sequence[str | Path] = (),
    difficulty_paths: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Fit on outcomes, export ``model.onnx`` + ``metadata.json`` into ``out_dir``; returns metadata.

    With subjects in the data, ``config.heldout_fraction`` of them (by hash) stay out of training
    and the metadata records the APGR measured on them.
    """
    import onnx
    import onnxruntime
    import skl2onnx
    import sklearn

    from classifier.training.priors import CATEGORY_GROUPS as groups
    from classifier.training.priors import prior_metadata
    from classifier.training.train import numerics_host

    outcomes_path, out = Path(outcomes_path), Path(out_dir)
    rows, weights, held, dropped = training_rows(
        outcomes_path, config, extra_paths, more_outcomes, difficulty_paths
    )
    pipeline = fit_outcomes(rows, config, weights)
    model = export_outcome_onnx(pipeline, {"version": OUTCOME_VERSION, "score": "outcome"})

    probe = [r["prompt"] for r in rows[:300]] + list(PARITY_PROBES)
    drift = float(np.abs(onnx_masses(model, probe) - tier_masses(outcome_proba(pipeline, probe))).max())
    if drift > 1e-4:
        raise RuntimeError(f"ONNX tier masses differ from scikit-learn by {drift:.2e}")

    out.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out / "model.onnx"))
    linear = pipeline.named_steps["classifier"]
    names = [str(n) for n in pipeline.named_steps["features"].get_feature_names_out()]
    coef = np.asarray(linear.coef_, dtype=np.float64).ravel()
    metrics: dict[str, Any] = {}
    if held:
        test = [r for r in load_outcomes(outcomes_path) if r.get("subject") in set(held)]
        value = onnx_masses(model, [r["prompt"] for r in test]) @ np.array([0.0, 0.5, 1.0])
        m = routing_metrics(value, [r["weak"] for r in test], [r["strong"] for r in test])
        length = routing_metrics(
            [len(r["prompt"]) for r in test], [r["weak"] for r in test], [r["strong"] for r in test]
        )
        metrics = {
            "heldout_subjects": held,
            "n": m["n"],
            "apgr": round(m["apgr"], 4),
            "cpt_50": round(m["cpt_50"], 4),
            "cpt_80": round(m["cpt_80"], 4),
            "apgr_prompt_length": round(length["apgr"], 4),
        }
    metadata: dict[str, Any] = {
        "name": "tiered-router-routing-score",
        "version": OUTCOME_VERSION,
        "score": "outcome",
        "labels": list(LABELS),
        "probabilities_output": "probabilities",
        "input": {"name": "text", "shape": [None, 2], "preprocessing": "classifier.text.model_views(x)"},
        "value": "P(the strong tier answers well where the cheap one does not); tiers ~ Binomial(2, value)",
        "created_at": "deterministic",
        "training_data": {
            "outcomes": {"path": outcomes_path.name, "sha256": _sha256(outcomes_path)},
            "extra": [{"path": Path(p).name, "sha256": _sha256(Path(p))} for p in extra_paths],
            "more_outcomes": [{"path": Path(p).name, "sha256": _sha256(Path(p))} for p in more_outcomes],
            "difficulty": [{"path": Path(p).name, "sha256": _sha256(Path(p))} for p in difficulty_paths],
            "n": len(rows),
            "positives": round(float(outcome_targets(rows).sum()), 2),
            "dropped_subjects": dropped,
        },
        "config": dataclasses.asdict(config),
        "features": {
            "count_groups": {
                k: list(v) for k, v in (groups if config.features == "prior" else OUTCOME_GROUPS)
            },
            **prior_metadata(pipeline),
            "word_tfidf": config.word_max_features,
        },
        "weights": {
            n.split("__", 1)[-1]: round(float(w), 4)
            for n, w in zip(names, coef, strict=True)
            if n.startswith("counts")
        },
        "intercept": round(float(np.asarray(linear.intercept_).ravel()[0]), 4),
        "onnx": {"sha256": _sha256(out / "model.onnx"), "max_abs_drift_vs_sklearn": drift},
        "numerics": numerics_host(),
        "versions": {
            "scikit-learn": sklearn.__version__,
            "skl2onnx": skl2onnx.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "metrics": metrics,
    }
    (out / "metadata.json").write_text(
        json.dumps(metadata, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return metadata


def lofo_fitter(
    config: Any = None,
    outcomes_path: str | Path | None = None,
    difficulty_paths: Sequence[str | Path] | None = None,
    extra_paths: Sequence[str | Path] | None = None,
) -> Any:
    """``fit_without(family)`` for :func:`classifier.validation.lofo_values`: the shipped training
    recipe (MMLU outcomes, proxy corpus, difficulty_7b; ``config``) minus one family's rows."""
    cfg = config if config is not None else OUTCOME_CONFIG
    base = Path(outcomes_path) if outcomes_path is not None else MMLU_OUTCOMES
    rated = list(difficulty_paths) if difficulty_paths is not None else [DIFFICULTY_7B]
    extra = list(extra_paths) if extra_paths is not None else [PROXY_PATH]
    for path in [base, *rated, *extra]:
        if not Path(path).is_file():
            raise FileNotFoundError(f"leave-one-family-out training data not at {path}")

    def fit_without(family: str) -> Any:
        rows, weights, _, _ = training_rows(base, cfg, extra, (), rated, exclude_families=[family])
        pipeline = fit_outcomes(rows, cfg, weights)
        return lambda prompts: outcome_proba(pipeline, prompts)

    return fit_without
