"""Version 4's features: a task/category prior and a bounded within-category length term (issue 56).

:class:`PriorLength` is :class:`~classifier.training.features.FamilyCounts` (the one-hot category
and the exam-question flags: the *prior*) with its length column replaced by the *within-category
difficulty* term

    k * tanh((log1p(characters) - center[category]) / k)

where ``center`` is the median log length of the category's training prompts (learned in ``fit``)
and ``k`` bounds it. Inside one category the term is strictly increasing in length, so a linear
model over these columns ranks a category's prompts exactly as prompt length does; across
categories it is centred, so a category whose prompts happen to be long (extraction, pasted
documents, HumanEval's docstrings) does not climb above a category with a larger measured gain,
and it saturates at ``+-k``: however long a prompt, its length moves the logit by less than
``|w| * k``, which the fitted prior gaps have to beat only where the data says so.

:data:`CATEGORY_GROUPS` are :data:`~classifier.text.OUTCOME_GROUPS` with the reasoning cues cut
to puzzle words (``why``, ``if``, ``each``, ``given``, ``order`` sent history, science and
extraction questions to the reasoning prior) and an ``extraction`` category (pull facts out of a
given text). The groups live here, not in :mod:`classifier.text`: only the graph needs them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from classifier.text import OUTCOME_GROUPS
from classifier.training.features import FamilyCounts, Groups, Rule, _as_list, emit_family_counts

__all__ = [
    "CATEGORY_DOMAINS",
    "CATEGORY_GROUPS",
    "LATEX_OVERRIDE",
    "PriorLength",
    "prior_metadata",
    "register_prior_converter",
]

REASONING_CUES: tuple[str, ...] = (
    "puzzle",
    "logic",
    "logical",
    "riddle",
    "deduce",
    "infer",
    "therefore",
    "lying",
    "liar",
    "lies",
    "truth",
    "arrangement",
    "step by",
    "older",
    "younger",
    "taller",
    "shorter",
    "conclusion",
    "assume",
    "suppose",
    "justify",
    "overtake",
    "overtaken",
    "finished",
    "labelled",
    "labeled",
    "wrong",
    "who is",
)
HUMANITIES_CUES: tuple[str, ...] = (
    "scenario",
    "moral",
    "morally",
    "law",
    "legal",
    "court",
    "statute",
    "defendant",
    "plaintiff",
    "constitutional",
    "philosopher",
    "ethics",
    "justice",
    "contract",
    "crime",
    "guilty",
)
EXTRACTION_CUES: tuple[str, ...] = (
    "extract",
    "identify",
    "json",
    "csv",
    "table",
    "format",
    "following text",
    "the following",
    "below",
    "mentioned",
    "passage",
    "article",
    "reviews",
    "categorize",
    "categories",
    "classify",
    "rating",
    "list all",
    "names",
    "return",
)
CATEGORY_GROUPS: Groups = (
    *((name, REASONING_CUES if name == "reasoning" else group) for name, group in OUTCOME_GROUPS),
    ("extraction", EXTRACTION_CUES),
    # LaTeX and Asymptote markup: symbolic maths (MATH's pre-algebra), not a word problem.
    ("latex", ("\\", "^", "asy")),
    # Exam questions on law and morals: where MMLU's strong model gains most (moral scenarios,
    # professional law; humanities +0.26 against +0.07 to +0.13 in the other categories).
    ("law_morals", HUMANITIES_CUES),
)
# Symbolic maths whenever the prompt carries LaTeX: on difficulty_7b the strong model's gain there
# is a third of a word problem's (+0.15 vs +0.40), so the two must not share one prior.
LATEX_OVERRIDE = ("math_symbols", (("latex", 1),))
# The categories (argmax of their cue counts, first on ties: maths and code before the open ones).
CATEGORY_DOMAINS: tuple[str, ...] = (
    "math_symbols",
    "math_words",
    "code",
    "reasoning",
    "extraction",
    "roleplay",
    "writing",
    "chat",
)


class PriorLength(FamilyCounts):
    """``[k * tanh((log1p(chars) - center[category]) / k), one-hot category, flags]``.

    ``bound`` is ``k``; ``center_`` (one per category, then one for prompts of no category) is the
    median log length of all ``fit`` prompts, or with ``per_category`` of each category's (the
    overall median where a category has none). Per-category centres were measured and not shipped:
    they stop a short chat question from scoring below a long one of another category, and
    the labelled corpus' small prompts then spread over all tiers (classifier/README.md).
    """

    def __init__(
        self,
        groups: Groups | None = None,
        gate: str | None = None,
        gated: tuple[str, ...] = (),
        gate_at: int = 1,
        domains: tuple[str, ...] = (),
        overrides: tuple[tuple[str, Rule], ...] = (),
        flags: Rule = (),
        length_unit: str = "chars",
        flag_scope: tuple[str, int] | None = None,
        bound: float = 1.0,
        per_category: bool = False,
    ) -> None:
        super().__init__(groups, gate, gated, gate_at, domains, overrides, flags, length_unit, flag_scope)
        self.bound = bound
        self.per_category = per_category

    def _raw(self, x: Any) -> np.ndarray:
        return np.asarray(FamilyCounts.transform(self, x), dtype=np.float64)

    @staticmethod
    def _category(onehot: np.ndarray) -> np.ndarray:
        """Category index per row; ``len(domains)`` for rows of no category."""
        return np.where(onehot.max(axis=1) > 0, onehot.argmax(axis=1), onehot.shape[1])

    def fit(self, x: Any, y: Any = None) -> PriorLength:
        super().fit(x, y)
        if self.length_unit != "chars" or not self.bound > 0:
            raise ValueError("PriorLength needs length_unit='chars' and a positive bound")
        raw = self._raw(_as_list(x))
        n = len(self.domains)
        cat = self._category(raw[:, 1 : 1 + n])
        overall = float(np.median(raw[:, 0])) if len(raw) else 0.0
        self.center_ = np.array(
            [
                float(np.median(raw[cat == c, 0])) if self.per_category and np.any(cat == c) else overall
                for c in range(n + 1)
            ]
        )
        return self

    def transform(self, x: Any) -> np.ndarray:
        raw = self._raw(x)
        n = len(self.domains)
        cat = self._category(raw[:, 1 : 1 + n])
        k = float(self.bound)
        raw[:, 0] = k * np.tanh((raw[:, 0] - self.center_[cat]) / k)
        return raw.astype(np.float32)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        names = super().get_feature_names_out(input_features)
        names[0] = "within_length"
        return names


def _convert_prior_length(scope: Any, operator: Any, container: Any) -> None:
    """FamilyCounts' graph, then its length column swapped for the bounded, centred term."""
    from onnx import TensorProto

    raw: PriorLength = operator.raw_operator
    name = scope.get_unique_variable_name
    family_out = name("family_columns")
    emit_family_counts(scope, operator, container, family_out)
    n = len(raw.domains)
    width = raw.n_features_out_

    def const(prefix: str, dtype: int, dims: list[int], values: Any) -> str:
        var = name(prefix)
        container.add_initializer(var, dtype, dims, values)
        return var

    def node(op: str, inputs: list[str], **attrs: Any) -> str:
        out = name(op.lower())
        container.add_node(op, inputs, out, name=name(op), **attrs)
        return out

    def cols(start: int, stop: int) -> str:
        idx = const("cols", TensorProto.INT64, [stop - start], list(range(start, stop)))
        return node("Gather", [family_out, idx], axis=1)

    length, onehot = cols(0, 1), cols(1, 1 + n)
    centers = [float(c) for c in raw.center_]
    # center = onehot @ (center[c] - center[none]) + center[none]: rows of no category get the last.
    delta = const("centers", TensorProto.FLOAT, [n, 1], [c - centers[n] for c in centers[:n]])
    base = const("center_none", TensorProto.FLOAT, [], [centers[n]])
    center = node("Add", [node("MatMul", [onehot, delta]), base])
    k = const("bound", TensorProto.FLOAT, [], [float(raw.bound)])
    within = node("Mul", [k, node("Tanh", [node("Div", [node("Sub", [length, center]), k])])])
    parts = [within, onehot] if width == 1 + n else [within, onehot, cols(1 + n, width)]
    container.add_node("Concat", parts, operator.outputs[0].full_name, name=name("Concat"), axis=1)


def prior_metadata(pipeline: Any) -> dict[str, Any]:
    """PriorLength's learned centres (log1p characters per category) and bound, where it is used."""
    counts = pipeline.named_steps["features"].named_transformers_["counts"].steps[0][1]
    if not isinstance(counts, PriorLength):
        return {}
    keys = [*counts.domains, "none"]
    return {
        "bound": counts.bound,
        "centers": dict(zip(keys, np.round(counts.center_, 4).tolist(), strict=True)),
    }


_registered = False


def register_prior_converter() -> None:
    """Teach skl2onnx to convert :class:`PriorLength` (idempotent)."""
    global _registered
    if _registered:
        return
    from skl2onnx import update_registered_converter

    from classifier.training.features import _shape_token_counts, register_converters

    register_converters()
    update_registered_converter(
        PriorLength, "TieredRouterPriorLength", _shape_token_counts, _convert_prior_length
    )
    _registered = True
