"""The device side: the model runner (inputs, KV pool, forward, logits) and the worker that steps
the engines on one device. May import models, attention, layers, kernels and core."""
