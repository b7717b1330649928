"""Passes over the exported ONNX graph that make it exact and fast (training side, needs onnx).

skl2onnx converts each step on its own and literally; these passes fix one conversion bug and
remove the work that the literal translation repeats. The training pipeline checks the result
against scikit-learn's probabilities (max abs difference 1e-4) before anything is written.
"""

from __future__ import annotations

from typing import Any

from classifier.training.features import PAD

__all__ = [
    "fix_tokenizer_pads",
    "fuse_binary_idf",
    "merge_duplicate_nodes",
    "optimize",
    "replace_l2_normalizers",
]


def fix_tokenizer_pads(model: Any) -> Any:
    """Give every Tokenizer node the pad value :data:`~classifier.training.features.PAD`, in place;
    returns ``model``.

    skl2onnx picks the pad of a TF-IDF tokenizer as "#" unless "#" is in the vocabulary, but the
    Traceable vectorizers key their vocabulary by tuples, so the check never fires and a "#" token
    in the vocabulary counts every pad slot of a batch as a "#" (single-row runs are unaffected).
    PAD can never be a token, and the n-gram counter never looks at pads, so this is safe.
    """
    from onnx import helper

    for node in model.graph.node:
        if node.op_type == "Tokenizer":
            kept = [a for a in node.attribute if a.name != "pad_value"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("pad_value", PAD)])
    return model


def merge_duplicate_nodes(model: Any) -> Any:
    """Common-subexpression elimination over the ONNX graph, in place; returns ``model``.

    skl2onnx converts each branch of the ColumnTransformer on its own: the full-text column is
    extracted twice and tokenized twice (TF-IDF and TokenCounts use the same regex). onnxruntime's
    own elimination does not merge them because their constant inputs are distinct initializers,
    so this pass keys nodes by op, attributes and inputs, with initializers compared by content.
    """
    graph = model.graph
    # An initializer's serialization includes its name; compare dtype, shape and values only.
    init_key: dict[str, Any] = {}
    for init in graph.initializer:
        clone = type(init)()
        clone.CopyFrom(init)
        clone.name = ""
        init_key[init.name] = ("init", clone.SerializeToString())
    renamed: dict[str, str] = {}
    seen: dict[Any, Any] = {}
    kept = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        attrs = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
        key = (
            node.domain,
            node.op_type,
            attrs,
            tuple(init_key.get(n, n) for n in node.input),
            len(node.output),
        )
        first = seen.get(key)
        if first is None:
            seen[key] = node
            kept.append(node)
        else:
            renamed.update(zip(node.output, first.output, strict=True))
    graph_outputs = {o.name for o in graph.output}
    if graph_outputs & set(renamed):
        raise ValueError("a graph output would be merged away")
    del graph.node[:]
    graph.node.extend(kept)
    _drop_unused_initializers(graph)
    return model


def _consumers(graph: Any) -> dict[str, list[Any]]:
    users: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    return users


def _attr(node: Any, name: str) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def fuse_binary_idf(model: Any) -> Any:
    """TfIdfVectorizer(TF) -> Cast(bool) -> Cast(float) -> Mul(idf)  ==>  TfIdfVectorizer(IDF).

    That chain is skl2onnx's literal ``binary=True`` TF-IDF; ONNX's "IDF" mode computes the same
    (presence times weight) in one pass, sparing three operations over the dense vocabulary-wide
    vector for every prompt.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    users = _consumers(graph)
    inits = {i.name: i for i in graph.initializer}
    drop: set[int] = set()
    replace: dict[int, Any] = {}
    for node in graph.node:
        if node.op_type != "TfIdfVectorizer" or _attr(node, "mode") != b"TF":
            continue
        chain = [node]
        for op_type in ("Cast", "Cast", "Mul"):
            nxt = users.get(chain[-1].output[0], [])
            if len(nxt) != 1 or nxt[0].op_type != op_type:
                break
            chain.append(nxt[0])
        if len(chain) != 4:
            continue
        _, to_bool, to_float, mul = chain
        idf_name = next((n for n in mul.input if n in inits), None)
        if _attr(to_bool, "to") != 9 or _attr(to_float, "to") != 1 or idf_name is None:
            continue
        idf = numpy_helper.to_array(inits[idf_name]).ravel()
        attrs = {
            a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in ("mode", "weights")
        }
        if len(idf) != max(attrs["ngram_indexes"]) + 1:
            continue
        weights = [float(idf[i]) for i in attrs["ngram_indexes"]]
        fused = helper.make_node(
            "TfIdfVectorizer",
            list(node.input),
            [mul.output[0]],
            name=node.name,
            mode="IDF",
            weights=weights,
            **attrs,
        )
        replace[id(node)] = fused
        drop.update(id(n) for n in (to_bool, to_float, mul))
    nodes = [replace.get(id(n), n) for n in graph.node if id(n) not in drop]
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unused_initializers(graph)
    return model


def replace_l2_normalizers(model: Any) -> Any:
    """ai.onnx.ml Normalizer(L2) ==> ReduceL2, Max(tiny), Div: the same rows, several times faster.

    A zero row stays zero (0 / tiny), as in scikit-learn's normalize().
    """
    from onnx import TensorProto, helper

    graph = model.graph
    nodes = []
    for node in graph.node:
        if node.op_type != "Normalizer" or _attr(node, "norm") != b"L2":
            nodes.append(node)
            continue
        x, out, base = node.input[0], node.output[0], node.name or node.output[0]
        axes, tiny = f"{base}_axes", f"{base}_tiny"
        graph.initializer.append(helper.make_tensor(axes, TensorProto.INT64, [1], [1]))
        graph.initializer.append(helper.make_tensor(tiny, TensorProto.FLOAT, [], [1e-12]))
        nodes += [
            helper.make_node("ReduceL2", [x, axes], [f"{base}_norm"], name=f"{base}_ReduceL2", keepdims=1),
            helper.make_node("Max", [f"{base}_norm", tiny], [f"{base}_safe"], name=f"{base}_Max"),
            helper.make_node("Div", [x, f"{base}_safe"], [out], name=f"{base}_Div"),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _drop_unused_initializers(graph: Any) -> None:
    used = {n for node in graph.node for n in node.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)


def optimize(model: Any) -> Any:
    """All passes, in order; returns ``model`` (modified in place)."""
    fix_tokenizer_pads(model)
    merge_duplicate_nodes(model)
    fuse_binary_idf(model)
    replace_l2_normalizers(model)
    return model
