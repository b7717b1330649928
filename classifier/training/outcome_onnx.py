"""ONNX export of the outcome-trained routing score: the scikit-learn pipeline as one graph, plus the
tier head that turns P(gain) into Binomial(2, p) masses over small/medium/large.

The graph outputs the same ``probabilities`` [N, 3] as the complexity model, so policies,
``predicted`` and escalation keep working: with ``p = P(gain)`` the tiers get ``(1-p)^2, 2p(1-p),
p^2``, whose expected tier weight ``0.5 * P(medium) + P(large)`` is exactly ``p``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from classifier.data import LABELS

__all__ = ["export_outcome_onnx", "onnx_masses", "tier_masses"]


def tier_masses(p: np.ndarray) -> np.ndarray:
    """[N, 3] Binomial(2, p) masses in LABELS order; their expected tier weight is p."""
    p = np.asarray(p, dtype=np.float64).reshape(-1, 1)
    q = 1.0 - p
    return np.hstack([q * q, 2.0 * p * q, p * p])


def _append_tier_head(model: Any) -> Any:
    """Rename the binary ``probabilities`` output and compute the three tier masses from it."""
    from onnx import TensorProto, helper

    graph = model.graph
    binary = "gain_probabilities"
    for node in graph.node:
        for i, out in enumerate(node.output):
            if out == "probabilities":
                node.output[i] = binary
    for o in list(graph.output):
        graph.output.remove(o)

    def const(name: str, dtype: int, dims: list[int], vals: list[Any]) -> str:
        graph.initializer.append(helper.make_tensor(name, dtype, dims, vals))
        return name

    one = const("tier_one", TensorProto.FLOAT, [], [1.0])
    two = const("tier_two", TensorProto.FLOAT, [], [2.0])
    idx = const("tier_gain_index", TensorProto.INT64, [1], [1])
    graph.node.extend(
        [
            helper.make_node("Gather", [binary, idx], ["tier_p"], name="tier_p", axis=1),
            helper.make_node("Sub", [one, "tier_p"], ["tier_q"], name="tier_q"),
            helper.make_node("Mul", ["tier_q", "tier_q"], ["tier_small"], name="tier_small"),
            helper.make_node("Mul", ["tier_p", "tier_q"], ["tier_pq"], name="tier_pq"),
            helper.make_node("Mul", [two, "tier_pq"], ["tier_medium"], name="tier_medium"),
            helper.make_node("Mul", ["tier_p", "tier_p"], ["tier_large"], name="tier_large"),
            helper.make_node(
                "Concat",
                ["tier_small", "tier_medium", "tier_large"],
                ["probabilities"],
                name="tier_probabilities",
                axis=1,
            ),
        ]
    )
    graph.output.append(helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 3]))
    return model


def export_outcome_onnx(pipeline: Any, metadata: dict[str, str] | None = None) -> Any:
    """One graph: ``text`` [N, 2] -> ``probabilities`` [N, 3] (small, medium, large)."""
    import onnx

    from classifier.training.graph import optimize
    from classifier.training.train import IR_VERSION, convert_pipeline

    model = convert_pipeline(pipeline, "tiered-router-routing-score")
    _append_tier_head(model)
    # The label output is gone: drop the nodes that only fed it.
    _prune(model)
    optimize(model)
    model.ir_version = IR_VERSION
    # skl2onnx collects opset domains in a set: sort them so retraining is byte-for-byte stable
    # across processes (string hashing is randomized per process).
    opsets = sorted((o.domain, o.version) for o in model.opset_import)
    del model.opset_import[:]
    for domain, version in opsets:
        model.opset_import.add(domain=domain, version=version)
    model.producer_name = "tiered-router"
    model.doc_string = (
        "Routing score: model_views() strings in; Binomial(2, P(strong tier needed)) tier masses out."
    )
    props = {"labels": json.dumps(list(LABELS)), **(metadata or {})}
    onnx.helper.set_model_props(model, props)
    onnx.checker.check_model(model)
    return model


def _prune(model: Any) -> None:
    graph = model.graph
    needed = {o.name for o in graph.output}
    kept: list[Any] = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = {n for node in graph.node for n in node.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)


def onnx_masses(model: Any, prompts: Sequence[str]) -> np.ndarray:
    import onnxruntime as ort

    from classifier.training.train import model_rows

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probs = np.asarray(session.run(["probabilities"], {"text": model_rows(prompts)})[0], dtype=np.float64)
    return probs
