"""Training pipeline: normalized text -> features -> linear model -> calibrated probabilities -> ONNX.

``train()`` fits the chosen configuration on a labeled JSONL file and exports ONE ONNX graph
(string input ``text`` of shape [N, 2], the rows of :func:`classifier.text.model_views`: the
normalized text and its ask view; output ``probabilities`` [N, 3]) plus ``metadata.json``. It
checks that onnxruntime reproduces scikit-learn's probabilities and reports metrics on the
held-out split.

Model selection (:mod:`classifier.training.selection`, ``python -m classifier.training.selection``)
measures candidate configurations on a validation split carved from train.jsonl;
classifier/README.md records it.
Everything is deterministic given ``seed``: fixed, hash-based splits, deterministic solvers, and
seeded cross-validation folds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from classifier.data import HELDOUT_PATH, LABELS, TRAIN_PATH, load_jsonl
from classifier.text import (
    ASK_TOKENS,
    COUNT_FEATURES,
    HEAD_CHARS,
    MAX_CHARS,
    TAIL_CHARS,
    WORD_TOKEN_PATTERN,
    model_views,
)
from classifier.validation.evaluate import evaluate

__all__ = [
    "CANDIDATES",
    "DEFAULT_CONFIG",
    "MODEL_VERSION",
    "Config",
    "export_onnx",
    "fit",
    "model_rows",
    "onnx_proba",
    "predict_proba",
    "train",
]

MODEL_VERSION = "1.0.0"
TARGET_OPSET = {"": 19, "ai.onnx.ml": 3}
# onnxruntime 1.31 reads models up to IR version 13; pin what opset 19 (string Equal) needs, so
# that newer onnx packages cannot stamp a version the runtime refuses.
IR_VERSION = 9


@dataclass(frozen=True)
class Config:
    """One candidate: features, linear model and calibration."""

    name: str
    model: str = "logreg"  # "logreg" | "svm" (LinearSVC) | "sgd" (SGDClassifier, modified Huber)
    c: float = 4.0  # inverse regularization strength (sgd: alpha = 1 / (c * n_samples))
    calibration: str = "temperature"  # "none" | "sigmoid" (Platt, CV ensemble) | "temperature"
    word_ngrams: tuple[int, int] = (1, 2)
    word_max_features: int = 8000
    char_ngrams: tuple[int, int] | None = None
    char_max_features: int = 20000
    char_view: int = 0  # 0: char n-grams of the full text, 1: of the ask view only (cheaper)
    counts: bool = True
    ask: bool = True  # a second word TF-IDF over the ask view (classifier.text.ask_text)
    min_df: int = 2
    # Term frequency: "binary" (presence) or "raw" counts. Not sublinear: skl2onnx exports
    # scikit-learn's 1 + log(tf) as log(1 + tf), which the parity check rejects.
    tf: str = "binary"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Inverse of ``dataclasses.asdict`` after a JSON round trip (lists back to tuples)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields
        }
        return cls(**values)


CANDIDATES: dict[str, Config] = {
    c.name: c
    for c in (
        Config("lr-word", c=16.0, counts=False, ask=False),
        Config("lr-word+counts", c=16.0, ask=False),
        Config("lr-word+counts+ask", c=16.0),
        Config("lr-word+counts+ask/uncalibrated", c=16.0, calibration="none"),
        Config("svm-word+counts+ask", model="svm", c=1.0),
        Config("svm-word+counts+ask/platt", model="svm", c=1.0, calibration="sigmoid"),
        Config("svm-word+counts+ask+char", model="svm", c=1.0, char_ngrams=(3, 5), char_view=1),
        Config("sgd-word+counts+ask", model="sgd", c=16.0),
    )
}
DEFAULT_CONFIG = CANDIDATES["svm-word+counts+ask+char"]


def model_rows(prompts: Sequence[object]) -> np.ndarray:
    """The graph's ``text`` input for ``prompts``: [N, 2] strings (full text, ask view)."""
    return np.array([model_views(p)[0] for p in prompts], dtype=object).reshape(-1, 2)


def _features(config: Config) -> Any:
    """ColumnTransformer over the two views: column 0 the full text, column 1 the ask view."""
    from skl2onnx.sklapi import TraceableTfidfVectorizer
    from sklearn.compose import ColumnTransformer
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from classifier.training.features import TokenCounts

    common = {
        "lowercase": False,
        "min_df": config.min_df,
        "binary": config.tf == "binary",
        "dtype": np.float32,
    }

    def words() -> Any:
        # Traceable: n-grams keyed by token tuples, so the ONNX converter never has to guess
        # how to split a bigram string back into tokens.
        return TraceableTfidfVectorizer(
            token_pattern=WORD_TOKEN_PATTERN,
            ngram_range=config.word_ngrams,
            max_features=config.word_max_features,
            **common,
        )

    parts: list[tuple[str, Any, int]] = [("word", words(), 0)]
    if config.char_ngrams is not None:
        # Plain vectorizer: the Traceable one cannot fit char n-grams (and need not: a char
        # n-gram splits unambiguously into characters).
        char = TfidfVectorizer(
            analyzer="char", ngram_range=config.char_ngrams, max_features=config.char_max_features, **common
        )
        parts.append(("char", char, config.char_view))
    if config.counts:
        parts.append(("counts", Pipeline([("tokens", TokenCounts()), ("scale", StandardScaler())]), 0))
    if config.ask:
        parts.append(("ask", words(), 1))
    return ColumnTransformer(parts, sparse_threshold=1.0)


def _linear(config: Config, n: int, seed: int) -> Any:
    from sklearn.linear_model import LogisticRegression, SGDClassifier
    from sklearn.svm import LinearSVC

    if config.model == "logreg":
        return LogisticRegression(C=config.c, max_iter=5000, tol=1e-6)
    if config.model == "svm":
        return LinearSVC(C=config.c, random_state=seed, max_iter=20000)
    if config.model == "sgd":
        return SGDClassifier(
            loss="modified_huber", alpha=1.0 / (config.c * n), max_iter=200, tol=1e-5, random_state=seed
        )
    raise ValueError(f"unknown model {config.model!r}")


def _folds(seed: int) -> Any:
    from sklearn.model_selection import StratifiedKFold

    return StratifiedKFold(n_splits=5, shuffle=True, random_state=seed)


def _temperature(scores: np.ndarray, y: np.ndarray) -> float:
    """The T minimizing the log loss of softmax(scores / T) (a 1-D search on log T)."""
    from scipy.optimize import minimize_scalar
    from scipy.special import log_softmax

    def nll(log_t: float) -> float:
        return float(-log_softmax(scores / np.exp(log_t), axis=1)[np.arange(len(y)), y].mean())

    return float(np.exp(minimize_scalar(nll, bounds=(-4.0, 4.0), method="bounded").x))


def _temperature_scaled(linear: Any, x: Any, y: Sequence[str], seed: int) -> Any:
    """Fit ``linear`` and fold a temperature into it, as a multinomial LogisticRegression.

    softmax(W x / T + b / T) is a logistic regression with coefficients W / T, so the calibrated
    model exports as one plain linear layer: no calibration ensemble to run at serving time.
    The temperature comes from out-of-fold decision scores, never from the rows being scored.
    """
    from sklearn.base import clone
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_predict

    y_arr = np.asarray(y)
    oof = cross_val_predict(clone(linear), x, y_arr, cv=_folds(seed), method="decision_function")
    fitted = clone(linear).fit(x, y_arr)
    classes = list(fitted.classes_)
    t = _temperature(np.asarray(oof, dtype=np.float64), np.array([classes.index(v) for v in y_arr]))
    scaled = LogisticRegression(C=1.0)
    scaled.classes_ = fitted.classes_
    scaled.coef_ = np.asarray(fitted.coef_, dtype=np.float64) / t
    scaled.intercept_ = np.asarray(fitted.intercept_, dtype=np.float64) / t
    scaled.n_features_in_ = fitted.coef_.shape[1]
    scaled.n_iter_ = np.array([0])
    scaled.temperature_ = t
    return scaled


def fit(prompts: Sequence[str], labels: Sequence[str], config: Config = DEFAULT_CONFIG, seed: int = 0) -> Any:
    """A fitted scikit-learn Pipeline(features, classifier) over model_rows() input."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.pipeline import Pipeline

    from classifier.training.features import register_converters

    if set(labels) != set(LABELS):
        raise ValueError(f"training data must hold every label of {LABELS}, got {sorted(set(labels))}")
    register_converters()
    rows = model_rows(prompts)
    features = _features(config)
    x = features.fit_transform(rows)
    linear = _linear(config, len(rows), seed)
    if config.calibration == "temperature":
        clf = _temperature_scaled(linear, x, labels, seed)
    elif config.calibration == "sigmoid":
        clf = CalibratedClassifierCV(linear, method="sigmoid", cv=_folds(seed), ensemble=True).fit(x, labels)
    elif config.calibration == "none":
        if config.model == "svm":
            raise ValueError("LinearSVC has no probabilities: use a calibration")
        clf = linear.fit(x, labels)
    else:
        raise ValueError(f"unknown calibration {config.calibration!r}")
    return Pipeline([("features", features), ("classifier", clf)])


def predict_proba(pipeline: Any, prompts: Sequence[str]) -> np.ndarray:
    """scikit-learn probabilities in LABELS order (the reference the ONNX graph must match)."""
    probs = pipeline.predict_proba(model_rows(prompts))
    order = [list(pipeline.classes_).index(label) for label in LABELS]
    return np.asarray(probs)[:, order]


def convert_pipeline(pipeline: Any, name: str) -> Any:
    """skl2onnx's graph of a fitted features + classifier pipeline: ``text`` [N,2] in, the
    classifier's label and (no zipmap) probabilities out."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import StringTensorType

    from classifier.training.features import register_converters

    register_converters()
    clf = pipeline.named_steps["classifier"]
    with warnings.catch_warnings():
        # skl2onnx warns that char n-gram conversion "may not work"; train() checks that it does.
        warnings.filterwarnings("ignore", message="The conversion of CountVectorizer may not work")
        return convert_sklearn(
            pipeline,
            name=name,
            initial_types=[("text", StringTensorType([None, 2]))],
            options={id(clf): {"zipmap": False}},
            target_opset=TARGET_OPSET,
        )


def export_onnx(pipeline: Any, metadata: dict[str, str] | None = None) -> Any:
    """Convert the fitted pipeline into one ONNX graph: ``text`` [N,2] -> ``probabilities`` [N,3]."""
    import onnx

    from classifier.training.graph import optimize

    model = convert_pipeline(pipeline, "tiered-router-complexity")
    optimize(model)
    model.ir_version = IR_VERSION
    model.producer_name = "tiered-router"
    model.doc_string = "Prompt complexity: model_views() strings in, class probabilities out (see metadata)."
    if metadata:
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **metadata})
    onnx.checker.check_model(model)
    return model


def onnx_proba(model: Any, prompts: Sequence[str], labels: Sequence[str]) -> np.ndarray:
    """Run the exported graph on CPU; probabilities in LABELS order."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probs = session.run(["probabilities"], {"text": model_rows(prompts)})[0]
    return np.asarray(probs)[:, [list(labels).index(label) for label in LABELS]]


def numerics_host() -> str:
    """The widest SIMD that numpy and OpenBLAS dispatch on this CPU: "AVX512", "AVX2" or "baseline".

    Why it is recorded with an artifact: the fit's BLAS kernels and numpy's reductions pick their
    code path (and so their summation order) by it, so a retrain reproduces an artifact to the bit
    only on a host of the same kind (the shipped ones reproduce on AVX512 hosts; on an AVX2 AMD EPYC
    the complexity model's held-out accuracy came out 0.8880 vs 0.8866, one prompt of 741)."""
    from numpy._core._multiarray_umath import __cpu_features__ as features

    if features.get("AVX512F"):
        return "AVX512"
    return "AVX2" if features.get("AVX2") and features.get("FMA3") else "baseline"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _created_at() -> str:
    # SOURCE_DATE_EPOCH makes metadata.json byte-for-byte reproducible when wanted.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    stamp = datetime.fromtimestamp(int(epoch), UTC) if epoch else datetime.now(UTC)
    return stamp.replace(microsecond=0).isoformat()


PARITY_PROBES = (
    "",
    "hi",
    "¿Qué hora es?",
    "日本語の質問です",
    "def f(x):\n    return {x: [1, 2]}",
    "a" * 5000,
)


def train(
    data_path: str | Path = TRAIN_PATH,
    out_dir: str | Path = "classifier/artifacts",
    seed: int = 0,
    config: Config = DEFAULT_CONFIG,
    heldout_path: str | Path | None = HELDOUT_PATH,
) -> dict[str, Any]:
    """Fit, export ``model.onnx`` + ``metadata.json`` into ``out_dir``; returns the metadata."""
    import onnx
    import onnxruntime
    import skl2onnx
    import sklearn

    data_path, out = Path(data_path), Path(out_dir)
    rows = [r for r in load_jsonl(data_path) if r.get("label") is not None]
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    start = time.perf_counter()
    pipeline = fit(prompts, labels, config, seed)
    fit_seconds = time.perf_counter() - start
    classes = [str(c) for c in pipeline.classes_]
    model = export_onnx(pipeline, {"labels": json.dumps(classes), "version": MODEL_VERSION})

    # The graph must reproduce scikit-learn (tokenizer regexes, n-gram pools, count features).
    probe = prompts[:500] + list(PARITY_PROBES)
    drift = float(np.abs(onnx_proba(model, probe, classes) - predict_proba(pipeline, probe)).max())
    if drift > 1e-4:
        raise RuntimeError(f"ONNX probabilities differ from scikit-learn by {drift:.2e}")

    out.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out / "model.onnx"))
    clf = pipeline.named_steps["classifier"]
    metadata: dict[str, Any] = {
        "name": "tiered-router-complexity",
        "version": MODEL_VERSION,
        "labels": classes,
        "probabilities_output": "probabilities",
        "input": {"name": "text", "shape": [None, 2], "preprocessing": "classifier.text.model_views(x)"},
        "value": "P(medium) * 0.5 + P(large) * 1.0",
        "seed": seed,
        "created_at": _created_at(),
        "training_data": {"path": data_path.name, "sha256": _sha256(data_path), "n": len(rows)},
        "config": dataclasses.asdict(config),
        "features": {
            "word_token_pattern": WORD_TOKEN_PATTERN,
            "vocabulary": {
                name: len(step.vocabulary_)
                for name, step, _ in pipeline.named_steps["features"].transformers_
                if hasattr(step, "vocabulary_")
            },
            "ask_tokens": ASK_TOKENS,
            "count_features": {k: list(v) for k, v in COUNT_FEATURES} if config.counts else {},
            "truncation": {"max_chars": MAX_CHARS, "head_chars": HEAD_CHARS, "tail_chars": TAIL_CHARS},
        },
        "temperature": getattr(clf, "temperature_", None),
        "onnx": {
            "sha256": _sha256(out / "model.onnx"),
            "opset": TARGET_OPSET,
            "max_abs_drift_vs_sklearn": drift,
        },
        "numerics": numerics_host(),
        "versions": {
            "scikit-learn": sklearn.__version__,
            "skl2onnx": skl2onnx.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "fit_seconds": round(fit_seconds, 2),
        "metrics": {},
    }
    if (
        heldout_path is not None
        and Path(heldout_path).is_file()
        and Path(heldout_path).resolve() != data_path.resolve()
    ):
        # Written first so that evaluate() can load the directory, then rewritten with the metrics.
        (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        metadata["metrics"] = {
            "heldout": evaluate(heldout_path, out),
            "heldout_sha256": _sha256(Path(heldout_path)),
        }
    (out / "metadata.json").write_text(
        json.dumps(metadata, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return metadata
