"""Prompt complexity classifier: scikit-learn training, one ONNX graph, onnxruntime inference.

from classifier import ComplexityClassifier
clf = ComplexityClassifier.load()          # the shipped artifact in classifier/artifacts/
clf.score("hi").tier                       # "small"
"""

from __future__ import annotations

from classifier.inference import ComplexityClassifier, ComplexityScore

__all__ = ["ComplexityClassifier", "ComplexityScore"]
