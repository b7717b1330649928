"""Training-side feature extractors, and the ONNX converter for the one that skl2onnx lacks.

Imported by :mod:`classifier.training.train` only: it needs scikit-learn and skl2onnx, which serving does
not. The features (assembled in :func:`classifier.training.train._features`) are all computed inside the
single exported ONNX graph from the two normalized views of :func:`classifier.text.model_views`:

* word TF-IDF (binary TF, unigrams + bigrams) of the full text and, separately, of the ask view,
  over :data:`~classifier.text.WORD_TOKEN_PATTERN` tokens, which keep punctuation and code
  symbols as tokens of their own;
* char TF-IDF (3-5-grams) of the ask view: robust to typos, to unseen inflections of domain
  terms, and to scripts written without spaces;
* :class:`TokenCounts`: log1p counts of tokens, lines, list items, numbers, questions, clauses,
  code symbols, quotes and constraint words. TF-IDF rows are L2-normalized and so forget how
  *much* a prompt asks; these counts restore it. :func:`register_converters` adds their converter
  (onnxruntime's ``Tokenizer``, ONNX's ``TfIdfVectorizer`` in count mode, ``MatMul``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin

from classifier.text import COUNT_FEATURES, TOTAL_TOKENS, WORD_TOKEN_PATTERN, count_features

__all__ = ["PAD", "FamilyCounts", "TokenCounts", "register_converters"]

# Tokenizer pads short rows with this value: two symbols, which the token regex never yields
# as one token (it emits non-alphanumerics one character at a time).
PAD = "#!"


def _as_list(x: Any) -> list[str]:
    arr = np.asarray(x, dtype=object)
    return [str(v) for v in arr.reshape(-1)]


Groups = tuple[tuple[str, tuple[str, ...]], ...]


class TokenCounts(TransformerMixin, BaseEstimator):
    """``log1p`` of token-group counts: :data:`classifier.text.COUNT_FEATURES` unless ``groups``.

    The routing score uses :data:`classifier.text.OUTCOME_GROUPS` (the same counts plus domain
    cues); the first group must be the total token count. With ``gate``, the ``gated`` groups
    count only in prompts where the ``gate`` group counts fewer than ``gate_at`` (0 otherwise):
    the routing score gates its domain cues on "not a multiple-choice exam question" (see
    classifier/README.md).
    """

    def __init__(
        self,
        groups: Groups | None = None,
        gate: str | None = None,
        gated: tuple[str, ...] = (),
        gate_at: int = 1,
    ) -> None:
        self.groups = groups
        self.gate = gate
        self.gated = gated
        self.gate_at = gate_at
        """The gated groups are zeroed where the gate group counts at least this many."""

    def _mask(self) -> tuple[int, list[float]] | None:
        """``(gate column, 0/1 mask of gated columns)``, or None without a gate."""
        if self.gate is None:
            return None
        names = [name for name, _ in self._groups()]
        unknown = [g for g in (self.gate, *self.gated) if g not in names]
        if unknown:
            raise ValueError(f"unknown count groups {unknown}")
        return names.index(self.gate), [1.0 if n in self.gated else 0.0 for n in names]

    def _groups(self) -> Groups:
        return self.groups if self.groups is not None else COUNT_FEATURES

    def fit(self, x: Any, y: Any = None) -> TokenCounts:
        self.n_features_out_ = len(self._groups())
        return self

    def transform(self, x: Any) -> np.ndarray:
        groups = self._groups()
        rows = [count_features(t, groups) for t in _as_list(x)]
        counts = np.asarray(rows, dtype=np.float64).reshape(-1, self.n_features_out_)
        gating = self._mask()
        if gating is not None:
            col, mask = gating
            m = np.asarray(mask)
            counts = counts * ((1.0 - m) + m * (counts[:, [col]] < self.gate_at))
        return np.log1p(counts).astype(np.float32)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        return np.asarray([f"count_{name}" for name, _ in self._groups()], dtype=object)


Rule = tuple[tuple[str, int], ...]
# A rule as column indices: ((count column, at least), ...).
Columns = list[tuple[int, int]]


class FamilyCounts(TokenCounts):
    """Task family and length: ``[log1p(length), one-hot family, flags]`` from the gated group counts,
    the length in word tokens or (``length_unit="chars"``) characters of the model text.

    The family is the domain group (of ``domains``) with the most hits, first on ties, none when
    no domain group counts anything; each of ``overrides`` = ``((family, rule), ...)`` takes that
    family whenever every ``(group, at_least)`` of its rule holds, the first firing one winning
    (code: code symbols and a code word, whatever the maths words of a docstring say; maths: a
    word problem's numbers and maths words, whatever its "each" and "if" say). ``flags`` are 0/1
    columns ``group >= at_least``; with ``flag_scope = (group, at_least)`` they count only where
    that holds too (the symbol flag on exam questions only: on a free-form prompt the family
    already says what the symbols would, and a flag that a maths word problem's dollar signs
    set would break the family's ranking by length).

    The point is what this leaves out: inside one task family these columns are (nearly)
    constant, so the score of a linear model over them ranks a family's prompts by length alone
    (the one cheap signal measured to carry anything there), and the family columns carry only
    the between-family prior. Log counts of domain words, by contrast, vary inside a family and
    drown the length signal (classifier/README.md, "Routing score").
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
        length_unit: str = "tokens",
        flag_scope: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(groups, gate, gated, gate_at)
        self.length_unit = length_unit
        self.domains = domains
        self.overrides = overrides
        self.flags = flags
        self.flag_scope = flag_scope

    def _columns(self) -> tuple[list[int], list[tuple[int, Columns]], Columns, tuple[int, int] | None]:
        """Domain columns, each override's family position and rule, the flags and the flags'
        scope, as indices."""
        names = [n for n, _ in self._groups()]
        scope = [self.flag_scope] if self.flag_scope is not None else []
        wanted = [*self.domains, *(g for g, _ in [*self.flags, *scope])]
        for family, rule in self.overrides:
            wanted += [family, *(g for g, _ in rule)]
        unknown = [g for g in wanted if g not in names]
        if unknown or not self.domains:
            raise ValueError(f"unknown count groups {unknown}" if unknown else "no domain groups")
        strays = [f for f, _ in self.overrides if f not in self.domains]
        if strays:
            raise ValueError(f"override family {strays[0]!r} is not a domain")
        domains = [names.index(d) for d in self.domains]
        overrides = [
            (self.domains.index(f), [(names.index(g), at) for g, at in rule]) for f, rule in self.overrides
        ]
        flags = [(names.index(g), at) for g, at in self.flags]
        where = (names.index(scope[0][0]), scope[0][1]) if scope else None
        return domains, overrides, flags, where

    def fit(self, x: Any, y: Any = None) -> FamilyCounts:
        self._columns()
        self.n_groups_ = len(self._groups())
        if self.length_unit not in ("tokens", "chars"):
            raise ValueError(f"length_unit must be tokens or chars, not {self.length_unit!r}")
        self.n_features_out_ = 1 + len(self.domains) + len(self.flags)
        return self

    def transform(self, x: Any) -> np.ndarray:
        domains, overrides, flags, scope = self._columns()
        texts = _as_list(x)
        rows = [count_features(t, self._groups()) for t in texts]
        counts = np.asarray(rows, dtype=np.float64).reshape(-1, self.n_groups_)
        gating = self._mask()
        if gating is not None:
            col, mask = gating
            m = np.asarray(mask)
            counts = counts * ((1.0 - m) + m * (counts[:, [col]] < self.gate_at))
        hits = counts[:, domains]
        onehot = (np.arange(len(domains))[None, :] == hits.argmax(axis=1)[:, None]).astype(np.float64)
        onehot *= hits.max(axis=1, keepdims=True) > 0
        for family, rule in reversed(overrides):  # the first firing override is applied last
            fires = np.all([counts[:, g] >= at for g, at in rule], axis=0)
            onehot[fires] = np.eye(len(domains))[family]
        flag_cols = [(counts[:, [g]] >= at).astype(np.float64) for g, at in flags]
        if scope is not None:
            inside = (counts[:, [scope[0]]] >= scope[1]).astype(np.float64)
            flag_cols = [f * inside for f in flag_cols]
        if self.length_unit == "chars":
            length = np.log1p(np.asarray([[len(t)] for t in texts], dtype=np.float64))
        else:
            length = np.log1p(counts[:, [0]])
        return np.hstack([length, onehot, *flag_cols]).astype(np.float32)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        names = [
            "length",
            *(f"family_{d}" for d in self.domains),
            *(f"flag_{g}_{at}" for g, at in self.flags),
        ]
        return np.asarray(names, dtype=object)


def _convert_family_counts(scope: Any, operator: Any, container: Any) -> None:
    emit_family_counts(scope, operator, container, operator.outputs[0].full_name)


def emit_family_counts(scope: Any, operator: Any, container: Any, output: str) -> None:
    from onnx import TensorProto

    name = scope.get_unique_variable_name
    raw: FamilyCounts = operator.raw_operator
    domains, overrides, flags, flag_scope = raw._columns()
    counts = _emit_counts(scope, operator, container)

    def const(prefix: str, dtype: int, dims: list[int], values: Any) -> str:
        var = name(prefix)
        container.add_initializer(var, dtype, dims, values)
        return var

    def node(op: str, inputs: list[str], **attrs: Any) -> str:
        out = name(op.lower())
        container.add_node(op, inputs, out, name=name(op), **attrs)
        return out

    def gather(cols: list[int]) -> str:
        return node("Gather", [counts, const("cols", TensorProto.INT64, [len(cols)], cols)], axis=1)

    def at_least(cols: list[tuple[int, int]]) -> str:
        # Counts are whole numbers: c >= k  <=>  c > k - 0.5.
        ks = const("at_least", TensorProto.FLOAT, [1, len(cols)], [at - 0.5 for _, at in cols])
        return node("Greater", [gather([g for g, _ in cols]), ks])

    size = gather([0]) if raw.length_unit == "tokens" else _emit_char_count(scope, operator, container)
    length = node("Log", [node("Add", [size, const("one", TensorProto.FLOAT, [], [1.0])])])
    hits = gather(domains)
    best = node("ArgMax", [hits], axis=1, keepdims=1)  # first index on ties, as numpy
    positions = const("positions", TensorProto.INT64, [1, len(domains)], list(range(len(domains))))
    onehot = node("Cast", [node("Equal", [positions, best])], to=TensorProto.FLOAT)
    zero = const("zero", TensorProto.FLOAT, [], [0.0])
    axis1 = const("axis1", TensorProto.INT64, [1], [1])
    any_hit = node(
        "Cast", [node("Greater", [node("ReduceMax", [hits, axis1], keepdims=1), zero])], to=TensorProto.FLOAT
    )
    onehot = node("Mul", [onehot, any_hit])
    for family, rule in reversed(overrides):  # the first firing override is applied last
        fired = node("Cast", [at_least(rule)], to=TensorProto.FLOAT)
        fires = node("Greater", [node("ReduceMin", [fired, axis1], keepdims=1), zero])
        target = const(
            "override",
            TensorProto.FLOAT,
            [1, len(domains)],
            [float(i == family) for i in range(len(domains))],
        )
        onehot = node("Where", [fires, target, onehot])
    parts = [length, onehot]
    if flags:
        flag_cols = node("Cast", [at_least(flags)], to=TensorProto.FLOAT)
        if flag_scope is not None:
            inside = node("Cast", [at_least([flag_scope])], to=TensorProto.FLOAT)
            flag_cols = node("Mul", [flag_cols, inside])
        parts.append(flag_cols)
    container.add_node("Concat", parts, output, name=name("Concat"), axis=1)


def _emit_char_count(scope: Any, operator: Any, container: Any) -> str:
    """[N, 1] characters of the text input: a Tokenizer whose every character is a token, counted
    like the word total (the model text has no newlines: :func:`classifier.text.model_text`)."""
    from onnx import TensorProto

    name = scope.get_unique_variable_name
    raw_chars, chars, is_pad, is_char, as_float, total = (
        name("raw_chars"),
        name("chars"),
        name("char_pad"),
        name("is_char"),
        name("char_f"),
        name("char_total"),
    )
    container.add_node(
        "Tokenizer",
        operator.inputs[0].full_name,
        raw_chars,
        op_domain="com.microsoft",
        op_version=1,
        name=name("CharTokenizer"),
        pad_value=PAD,
        mark=0,
        mincharnum=1,
        tokenexp=".",
    )
    container.add_node("Flatten", raw_chars, chars, name=name("Flatten"))
    pad = name("pad")
    container.add_initializer(pad, TensorProto.STRING, [], [PAD.encode()])
    container.add_node("Equal", [chars, pad], is_pad, name=name("Equal"))
    container.add_node("Not", is_pad, is_char, name=name("Not"))
    container.add_node("Cast", is_char, as_float, name=name("Cast"), to=TensorProto.FLOAT)
    axis = name("axis1")
    container.add_initializer(axis, TensorProto.INT64, [1], [1])
    container.add_node("ReduceSum", [as_float, axis], total, name=name("ReduceSum"), keepdims=1)
    return total


def _shape_token_counts(operator: Any) -> None:
    from skl2onnx.common.data_types import FloatTensorType

    n = operator.inputs[0].get_first_dimension()
    operator.outputs[0].type = FloatTensorType([n, operator.raw_operator.n_features_out_])


def _pool(groups: Groups = COUNT_FEATURES) -> tuple[list[str], list[str], np.ndarray]:
    """Unigrams, bigrams, and the [pool, groups] 0/1 matrix summing pool counts into groups."""
    grouped = [(name, group) for name, group in groups if name != TOTAL_TOKENS]
    unigrams = sorted({g for _, group in grouped for g in group if " " not in g})
    bigrams = sorted({g for _, group in grouped for g in group if " " in g})
    pool = unigrams + bigrams
    matrix = np.zeros((len(pool), len(grouped)), dtype=np.float32)
    for j, (_, group) in enumerate(grouped):
        for g in group:
            matrix[pool.index(g), j] = 1.0
    return unigrams, bigrams, matrix


def _emit_counts(scope: Any, operator: Any, container: Any) -> str:
    """Add the nodes that count the groups (gated where asked); returns the raw counts' name [N, G]."""
    from onnx import TensorProto

    name = scope.get_unique_variable_name
    raw = operator.raw_operator
    groups = raw._groups()
    unigrams, bigrams, matrix = _pool(groups)
    if groups[0][0] != TOTAL_TOKENS:
        raise ValueError("the converter expects the total token count first")

    def const(prefix: str, dtype: int, dims: list[int], values: Any) -> str:
        var = name(prefix)
        container.add_initializer(var, dtype, dims, values)
        return var

    # Same node and attributes as skl2onnx's word TF-IDF tokenizer (once fix_tokenizer_pads has
    # run), so onnxruntime's common-subexpression elimination tokenizes each prompt only once.
    raw_tokens, tokens = name("raw_tokens"), name("tokens")
    container.add_node(
        "Tokenizer",
        operator.inputs[0].full_name,
        raw_tokens,
        op_domain="com.microsoft",
        op_version=1,
        name=name("Tokenizer"),
        pad_value=PAD,
        mark=0,
        mincharnum=1,
        tokenexp=WORD_TOKEN_PATTERN,
    )
    # [N, 1, T] -> [N, T]; a row without tokens gives [N, 0], whose sums below are 0.
    container.add_node("Flatten", raw_tokens, tokens, name=name("Flatten"))  # default axis=1, as skl2onnx
    # Total: the non-pad entries of each row.
    is_pad, is_tok, as_float, total = name("is_pad"), name("is_tok"), name("tok_f"), name("total")
    container.add_node(
        "Equal", [tokens, const("pad", TensorProto.STRING, [], [PAD.encode()])], is_pad, name=name("Equal")
    )
    container.add_node("Not", is_pad, is_tok, name=name("Not"))
    container.add_node("Cast", is_tok, as_float, name=name("Cast"), to=TensorProto.FLOAT)
    container.add_node(
        "ReduceSum",
        [as_float, const("axis1", TensorProto.INT64, [1], [1])],
        total,
        name=name("ReduceSum"),
        keepdims=1,
    )
    # Grouped counts: one n-gram counter over the pool, then a 0/1 matrix sums members per group.
    pool_counts, grouped = name("pool_counts"), name("grouped")
    container.add_node(
        "TfIdfVectorizer",
        tokens,
        pool_counts,
        name=name("TfIdfVectorizer"),
        op_version=9,
        mode="TF",
        min_gram_length=1,
        max_gram_length=2,
        max_skip_count=0,
        pool_strings=unigrams + [t for b in bigrams for t in b.split(" ")],
        ngram_counts=[0, len(unigrams)],
        ngram_indexes=list(range(len(unigrams) + len(bigrams))),
    )
    group_matrix = const("groups", TensorProto.FLOAT, list(matrix.shape), matrix.ravel().tolist())
    container.add_node("MatMul", [pool_counts, group_matrix], grouped, name=name("MatMul"))
    counts = name("counts")
    gating = raw._mask()
    joined = counts if gating is None else name("ungated")
    container.add_node("Concat", [total, grouped], joined, name=name("Concat"), axis=1)
    if gating is not None:
        # counts * ((1 - mask) + mask * [gate count < gate_at]): gated columns vanish where it fires.
        col, mask = gating
        width = len(mask)
        gate_count, gate_open, gate_float, opened, factor = (
            name("gate_count"),
            name("gate_open"),
            name("gate_float"),
            name("opened"),
            name("factor"),
        )
        index = const("gate_index", TensorProto.INT64, [1], [col])
        container.add_node("Gather", [joined, index], gate_count, name=name("Gather"), axis=1)
        at = const("gate_at", TensorProto.FLOAT, [], [float(raw.gate_at)])
        container.add_node("Less", [gate_count, at], gate_open, name=name("Less"))
        container.add_node("Cast", gate_open, gate_float, name=name("Cast"), to=TensorProto.FLOAT)
        mask_c = const("gate_mask", TensorProto.FLOAT, [1, width], mask)
        keep_c = const("gate_keep", TensorProto.FLOAT, [1, width], [1.0 - v for v in mask])
        container.add_node("Mul", [mask_c, gate_float], opened, name=name("Mul"))
        container.add_node("Add", [keep_c, opened], factor, name=name("Add"))
        container.add_node("Mul", [joined, factor], counts, name=name("Mul"))
    return counts


def _convert_token_counts(scope: Any, operator: Any, container: Any) -> None:
    from onnx import TensorProto

    name = scope.get_unique_variable_name
    counts = _emit_counts(scope, operator, container)
    one = name("one")
    container.add_initializer(one, TensorProto.FLOAT, [], [1.0])
    plus_one = name("plus_one")
    container.add_node("Add", [counts, one], plus_one, name=name("Add"))
    container.add_node("Log", plus_one, operator.outputs[0].full_name, name=name("Log"))


_registered = False


def register_converters() -> None:
    """Teach skl2onnx to convert :class:`TokenCounts` (idempotent)."""
    global _registered
    if _registered:
        return
    from skl2onnx import update_registered_converter
    from skl2onnx.sklapi import register  # registers the Traceable* vectorizers' converters

    del register
    update_registered_converter(
        TokenCounts, "TieredRouterTokenCounts", _shape_token_counts, _convert_token_counts
    )
    update_registered_converter(
        FamilyCounts, "TieredRouterFamilyCounts", _shape_token_counts, _convert_family_counts
    )
    _registered = True
