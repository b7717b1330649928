"""Training: the scikit-learn pipelines, their ONNX export and graph passes, and model selection.
May import classifier.validation, classifier.text and classifier.data; serving never imports this."""
