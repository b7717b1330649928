"""Serving-side scoring: one onnxruntime session over the shipped graph (no scikit-learn needed)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from classifier.text import MAX_CHARS, clean_text, model_views, views

__all__ = [
    "ARTIFACT_DIR",
    "COMPLEXITY_DIR",
    "ComplexityClassifier",
    "ComplexityScore",
    "message_text",
]

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"
# The shipped default (artifacts/) is the outcome-trained routing score; the earlier model of the
# hand-labeled complexity taxonomy stays loadable from here (``classifier train --data`` makes it).
COMPLEXITY_DIR = ARTIFACT_DIR / "complexity"
MODEL_FILE = "model.onnx"
METADATA_FILE = "metadata.json"
# Difficulty of each tier on the [0, 1] scale of ComplexityScore.value.
TIER_WEIGHTS: Mapping[str, float] = {"small": 0.0, "medium": 0.5, "large": 1.0}
_CONTEXT_ROLES = frozenset({"user", "assistant"})


@dataclass(frozen=True, slots=True)
class ComplexityScore:
    """How hard a prompt looks: the argmax ``tier``, a continuous ``value`` and the class mass."""

    tier: str
    value: float
    probabilities: dict[str, float] = field(default_factory=dict)
    truncated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "value": self.value,
            "probabilities": dict(self.probabilities),
            "truncated": self.truncated,
        }


def _content_text(content: Any) -> str:
    """OpenAI ``content``: a string, or a list of parts of which only text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if isinstance(content, Iterable) and not isinstance(content, bytes | bytearray):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
        return "\n".join(texts)
    return str(content)


def _last_user_turn(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            return i
    return -1


def _context(messages: Sequence[Mapping[str, Any]], budget: int) -> str:
    """At most ``budget`` characters of user/assistant turns, most recent first, oldest cut at its start."""
    kept: list[str] = []
    for msg in reversed(messages):
        if budget <= 0:
            break
        if not isinstance(msg, Mapping) or msg.get("role") not in _CONTEXT_ROLES:
            continue
        text = _content_text(msg.get("content")).strip()
        if not text:
            continue
        if len(text) > budget:
            text = text[len(text) - budget :]
        kept.append(text)
        budget -= len(text)
    return "\n\n".join(reversed(kept))


def message_text(messages: Sequence[Mapping[str, Any]], context_chars: int = 2000) -> tuple[str, bool]:
    """The text that :meth:`ComplexityClassifier.score_messages` scores, and whether it was truncated.

    The last user turn (cleaned and, if huge, truncated on its own), preceded by at most
    ``context_chars`` characters of the user/assistant turns before it, taken most recent first.
    Context only fills what the turn leaves of MAX_CHARS, so it can never push the turn itself
    out of the scored window. System and developer messages never count: they are the
    operator's, not the asker's, and a long system prompt would make every request look "large".
    """
    last = _last_user_turn(messages)
    if last < 0:
        return "", False
    turn, truncated = clean_text(_content_text(messages[last].get("content")))
    budget = min(max(0, int(context_chars)), MAX_CHARS - len(turn) - 2)
    context = clean_text(_context(messages[:last], budget))[0] if budget > 0 else ""
    return (f"{context}\n\n{turn}" if context else turn), truncated


def _gpu_visible() -> bool:
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


DEVICES = ("cpu", "auto", "cuda")


def _default_providers(device: str = "cpu") -> list[str]:
    """onnxruntime providers for ``device``.

    ``cpu`` (the default): the graph is ~1 MB and scores in ~0.1-0.4 ms on one CPU thread; on a GPU
    node the CUDA provider would open a second CUDA context and memory arena beside the tiers' and
    queue its kernels behind theirs, for a graph whose string operators run on the CPU anyway.
    ``auto``: CUDA first where a GPU device node exists (a CUDA-enabled wheel lists CUDA even on
    machines without one, and trying it there only logs an error). ``cuda``: CUDA first, always.
    """
    if device not in DEVICES:
        raise ValueError(f"classifier device must be one of {', '.join(DEVICES)}, not {device!r}")
    has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "cuda" or (device == "auto" and has_cuda and _gpu_visible()):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class ComplexityClassifier:
    """Scores prompt complexity with the exported ONNX graph.

    Thread-safe: onnxruntime's ``InferenceSession.run`` may be called concurrently, and this class
    holds no other mutable state, so one instance can serve an asyncio server's worker threads.
    """

    def __init__(
        self, session: ort.InferenceSession, metadata: Mapping[str, Any], path: Path | None = None
    ) -> None:
        self._session = session
        self.metadata: dict[str, Any] = dict(metadata)
        self.path = path
        self.labels: tuple[str, ...] = tuple(self.metadata["labels"])
        unknown = set(self.labels) - set(TIER_WEIGHTS)
        if unknown:
            raise ValueError(f"model labels {sorted(unknown)} are not tiers {sorted(TIER_WEIGHTS)}")
        model_input = session.get_inputs()[0]
        if model_input.type != "tensor(string)" or model_input.shape[-1] != 2:
            raise ValueError(
                f"expected a string input of shape [N, 2], got {model_input.type} {model_input.shape}"
            )
        self._input = model_input.name
        outputs = [o.name for o in session.get_outputs()]
        self._output = self.metadata.get("probabilities_output", "probabilities")
        if self._output not in outputs:
            raise ValueError(f"model has no output {self._output!r} (outputs: {outputs})")
        self._weights = [TIER_WEIGHTS[label] for label in self.labels]
        # probabilities dicts list the tiers from small to large, whatever the graph's class order.
        self._order = sorted(range(len(self.labels)), key=lambda i: TIER_WEIGHTS[self.labels[i]])

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
        device: str = "cpu",
    ) -> ComplexityClassifier:
        """Load a model directory (or its ``model.onnx``); the shipped artifact when ``path`` is None.

        ``device`` picks the providers (:func:`_default_providers`) unless ``providers`` names them;
        a CUDA session that cannot start (libraries that do not match the wheel) falls back to the
        CPU unless ``providers`` asked for it explicitly."""
        target = Path(path) if path is not None else ARTIFACT_DIR
        model_path = target / MODEL_FILE if target.is_dir() else target
        if not model_path.is_file():
            raise FileNotFoundError(f"no ONNX model at {model_path}")
        options = ort.SessionOptions()
        # One thread: scoring takes well under a millisecond, and the model engine needs the cores.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        chosen = list(providers) if providers is not None else _default_providers(device)
        try:
            session = ort.InferenceSession(str(model_path), sess_options=options, providers=chosen)
        except Exception:
            if providers is not None or chosen == ["CPUExecutionProvider"]:
                raise
            # A GPU whose CUDA/cuDNN libraries do not match the wheel: score on the CPU instead.
            session = ort.InferenceSession(
                str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        meta_path = model_path.with_name(METADATA_FILE)
        if meta_path.is_file():
            metadata = json.loads(meta_path.read_text(encoding="utf-8"))
        else:
            # The graph carries the essentials too, so a lone model.onnx still loads.
            props = session.get_modelmeta().custom_metadata_map
            metadata = {"labels": json.loads(props["labels"]), "version": props.get("version")}
        return cls(session, metadata, model_path)

    @property
    def providers(self) -> list[str]:
        return list(self._session.get_providers())

    @property
    def version(self) -> str | None:
        version = self.metadata.get("version")
        return str(version) if version is not None else None

    def _run(self, rows: Sequence[list[str]]) -> list[list[float]]:
        """Probabilities per row, as Python floats (3 numbers: plain Python beats numpy calls)."""
        batch = np.array(rows, dtype=object).reshape(-1, 2)
        out: list[list[float]] = self._session.run([self._output], {self._input: batch})[0].tolist()
        for i, probs in enumerate(out):
            clipped = [p if p > 0.0 else 0.0 for p in probs]
            total = sum(clipped)
            out[i] = [p / total for p in clipped] if total > 0.0 else [1.0 / len(probs)] * len(probs)
        return out

    def _make(self, probs: list[float], truncated: bool) -> ComplexityScore:
        value = sum(p * w for p, w in zip(probs, self._weights, strict=True))
        best = max(range(len(probs)), key=probs.__getitem__)
        return ComplexityScore(
            tier=self.labels[best],
            value=min(1.0, max(0.0, value)),
            probabilities={self.labels[i]: probs[i] for i in self._order},
            truncated=truncated,
        )

    def predict_proba(self, texts: Sequence[object]) -> np.ndarray:
        """Probabilities ``[n, len(labels)]`` in ``self.labels`` order (one batched run)."""
        if not texts:
            return np.zeros((0, len(self.labels)))
        return np.asarray(self._run([model_views(t)[0] for t in texts]), dtype=np.float64)

    def score(self, text: object) -> ComplexityScore:
        row, truncated = model_views(text)
        return self._make(self._run([row])[0], truncated)

    def score_batch(self, texts: Sequence[object]) -> list[ComplexityScore]:
        if not texts:
            return []
        rows = [model_views(t) for t in texts]
        probs = self._run([row for row, _ in rows])
        return [self._make(p, trunc) for p, (_, trunc) in zip(probs, rows, strict=True)]

    def score_messages(
        self, messages: Sequence[Mapping[str, Any]], context_chars: int = 2000
    ) -> ComplexityScore:
        """Score an OpenAI chat: the last user turn plus bounded earlier context (see message_text)."""
        text, truncated = message_text(messages, context_chars)
        return self._make(self._run([views(text)])[0], truncated)
