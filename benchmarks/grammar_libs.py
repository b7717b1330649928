"""xgrammar vs llguidance on this CPU, on the real SmolLM2 tokenizer: the numbers behind the choice
of grammar library in ``tiers/sample/grammar.py``.

For each library: the one-off tokenizer preparation, the compile time of three grammars (any JSON
object, a nested schema, a tool-call schema) cold and cached, and the per-token cost of computing
the next-token mask and advancing the matcher while walking a valid document token by token (the
work the engine does for every constrained row of every step).

    .venv/bin/pip install xgrammar   # the losing candidate is not a project dependency
    flock /tmp/bench.lock .venv/bin/python -m benchmarks.grammar_libs
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
PERSON_DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "country": "FR"},
}
WEATHER = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
WEATHER_DOC = {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}
CASES: list[tuple[str, dict[str, Any] | None, Any]] = [
    ("json_object", None, {"answer": "yes", "items": [1, 2, 3], "nested": {"ok": True}}),
    ("person_schema", PERSON, PERSON_DOC),
    ("tool_call_schema", WEATHER, WEATHER_DOC),
]


def _walk_xgrammar(compiled: Any, ids: list[int], vocab: int) -> list[float]:
    import torch
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        ok = matcher.accept_token(t)
        times.append(time.perf_counter() - started)
        assert ok, t
    del torch
    return times


def _walk_llguidance(tok: Any, grammar: str, ids: list[int], vocab: int) -> list[float]:
    import llguidance
    import llguidance.torch as llt

    matcher = llguidance.LLMatcher(tok, grammar)
    bitmask = llt.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        started = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, bitmask, 0)
        ok = matcher.consume_token(t)
        times.append(time.perf_counter() - started)
        assert ok, (t, matcher.get_error())
    return times


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "mean_ms": round(statistics.fmean(xs) * 1e3, 4),
        "p50_ms": round(xs[len(xs) // 2] * 1e3, 4),
        "p99_ms": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3, 4),
        "max_ms": round(xs[-1] * 1e3, 4),
    }


def main() -> None:
    import llguidance
    import llguidance.hf
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tiers.models.loading import materialize_embedded

    hf = AutoTokenizer.from_pretrained(materialize_embedded("smollm2-135m-instruct"))
    vocab = len(hf)
    out: dict[str, Any] = {"tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab, "libraries": {}}

    # xgrammar
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    x: dict[str, Any] = {"tokenizer_prep_s": round(time.perf_counter() - started, 3), "cases": {}}
    for name, schema, doc in CASES:
        ids = hf.encode(json.dumps(doc), add_special_tokens=False)
        started = time.perf_counter()
        compiled = (
            compiler.compile_builtin_json_grammar()
            if schema is None
            else compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        )
        cold = time.perf_counter() - started
        started = time.perf_counter()
        if schema is None:
            compiler.compile_builtin_json_grammar()
        else:
            compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        warm = time.perf_counter() - started
        steps = _walk_xgrammar(compiled, ids, vocab)
        x["cases"][name] = {
            "compile_ms": round(cold * 1e3, 2),
            "compile_cached_ms": round(warm * 1e3, 3),
            "tokens": len(ids),
            "per_token": _ms(steps),
        }
    out["libraries"]["xgrammar"] = x

    # llguidance
    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)  # type: ignore[arg-type]
    g: dict[str, Any] = {"tokenizer_prep_s": round(time.perf_counter() - started, 3), "cases": {}}
    for name, schema, doc in CASES:
        ids = hf.encode(json.dumps(doc), add_special_tokens=False)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}
        )
        started = time.perf_counter()
        llguidance.LLMatcher(lltok, grammar)  # llguidance compiles lazily: construction is the compile
        cold = time.perf_counter() - started
        steps = _walk_llguidance(lltok, grammar, ids, vocab)
        g["cases"][name] = {
            "compile_ms": round(cold * 1e3, 2),
            "compile_cached_ms": None,
            "tokens": len(ids),
            "per_token": _ms(steps),
        }
    out["libraries"]["llguidance"] = g
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_libs.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
