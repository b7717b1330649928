"""Grammar-constrained decoding: structured outputs and tool calls as a ``TokenConstraint``.

Built on llguidance (Earley parser over a token trie, lazy lexer). It was measured against
xgrammar on this CPU with the SmolLM2 tokenizer (``benchmarks/grammar_libs.py``, results in
``benchmarks/results/grammar_libs.json``): both compute a 49k-token mask in microseconds
(xgrammar ~4 µs/token after a 3-5 ms compile, llguidance ~10-20 µs/token with no compile step),
i.e. well under 1 % of a decode step either way. llguidance was chosen because it has no
dependencies (xgrammar pulls in triton and a TVM runtime, about 1 GB, for GPU kernels a CPU
build never uses) and because its Lark front end states the tool-call formats directly (free
text that may not contain a call marker, JSON schemas embedded with ``%json``).

Grammars are compiled once per (tokenizer, spec): ``GrammarCompiler.constraint`` deep-copies a
cached template matcher (sub-microsecond) instead of re-parsing the grammar (~1 ms).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "GrammarCompiler",
    "GrammarConstraint",
    "GrammarError",
    "GrammarSpec",
    "compiler_for",
    "json_options",
]


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled (the request's fault: a 400)."""


# JSON layout the constrained model writes: Python's ``json.dumps`` separators and no free
# whitespace. Free whitespace lets a small model loop on newlines until max_tokens; one fixed
# layout is what models have seen most and keeps outputs short.
_JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_options(*, strict: bool) -> dict[str, Any]:
    """llguidance JSON compile options. Non-strict schemas ignore keywords llguidance cannot
    enforce (``lenient``) rather than failing, as OpenAI's best-effort mode accepts any schema."""
    return {**_JSON_LAYOUT, "lenient": not strict}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What to constrain an output to. ``source`` is canonical text, so equal specs hash equal."""

    kind: Literal["json_schema", "lark", "regex"]
    source: str
    strict: bool = True
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(f"{self.kind}\0{int(self.strict)}\0{self.source}".encode()).hexdigest()
        object.__setattr__(self, "key", digest)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """OpenAI ``response_format: json_object``: any JSON object."""
        return cls.json_schema({"type": "object"}, strict=False)

    @classmethod
    def json_schema(cls, schema: dict[str, Any], *, strict: bool = True) -> GrammarSpec:
        # Key order is kept: it is the order the properties are generated in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(
                    self.source,
                    defaults=json_options(strict=self.strict),  # type: ignore[arg-type]
                )
            except ValueError as exc:
                raise GrammarError(f"invalid JSON schema: {exc}") from exc
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)


class GrammarConstraint:
    """One sequence's matcher state, as the engine's ``TokenConstraint``.

    ``fill_mask`` computes llguidance's packed bitmask and unpacks it into the engine's bool row;
    ``accept`` checks a token before consuming it, because llguidance's ``consume_token`` on a
    forbidden token puts the matcher in an error state it never leaves, while the protocol asks
    for "False and no state change" (speculative drafts are probed this way).
    """

    __slots__ = ("_bits", "_eos", "_matcher", "_vocab")

    def __init__(self, matcher: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = eos_token_id
        self._bits = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def fill_mask(self, mask: torch.Tensor) -> None:
        import torch

        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little").view(np.bool_)
        n = min(self._vocab, mask.shape[-1])
        if mask.device.type == "cpu":
            # numpy, not a torch copy: a 49k-element torch copy goes to the intra-op thread pool,
            # whose barriers cost milliseconds on a loaded 2-core machine (numpy: ~10 µs).
            row = mask.numpy()
            row[:n] = allowed[:n]
            row[n:] = False  # padded logit columns are no tokens at all
        else:
            mask[:n] = torch.from_numpy(allowed[:n]).to(mask.device, non_blocking=True)
            mask[n:] = False

    def accept(self, token_id: int) -> bool:
        if not 0 <= token_id < self._vocab:
            return False
        if token_id == self._eos:
            # validate_tokens does not count the stop token; it is allowed exactly when the
            # output so far is a complete sentence of the grammar.
            if not self._matcher.is_accepting():
                return False
        elif self._matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._matcher.get_error()}")

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may still go on)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None

    def fork(self) -> GrammarConstraint:
        """An independent copy in the same state (n > 1 choices sharing a prompt)."""
        return GrammarConstraint(self._matcher.deep_copy(), self._vocab, self._eos)


class GrammarCompiler:
    """Compiled grammars of one tokenizer, cached by spec hash (LRU)."""

    def __init__(self, tokenizer: Any, *, max_entries: int = 256) -> None:
        import llguidance.hf

        self.vocab_size = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0

    def _template(self, spec: GrammarSpec) -> Any:
        from llguidance import LLMatcher

        with self._lock:
            found = self._templates.get(spec.key)
            if found is not None:
                self._templates.move_to_end(spec.key)
                self.hits += 1
                return found
        grammar = spec.grammar_text()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._lltok)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        matcher = LLMatcher(self._lltok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short_error(matcher.get_error()))
        # The first mask, on a copy: a schema whose first row already passes llguidance's parser
        # limits (an object of ~800 optional properties) compiles, then errors at the first step,
        # which the engine could only report as a failed generation (a 500). Here it is a 400.
        probe = matcher.deep_copy()
        bits = np.zeros(((self.vocab_size + 31) // 32,), dtype=np.int32)
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if probe.is_error():
            raise GrammarError("the schema is too complex to enforce: " + _short_error(probe.get_error()))
        with self._lock:
            self.misses += 1
            self._templates[spec.key] = matcher
            while len(self._templates) > self.max_entries:
                self._templates.popitem(last=False)
        return matcher

    def validate(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` (and cache it); ``GrammarError`` when it cannot be."""
        self._template(spec)

    def constraint(self, spec: GrammarSpec) -> GrammarConstraint:
        return GrammarConstraint(self._template(spec).deep_copy(), self.vocab_size, self.eos_token_id)


def _short_error(message: str) -> str:
    """llguidance's error without the state dump and grammar it appends (kilobytes of JSON)."""
    found = re.search(r"Error: ([^\n<]+)", message)
    line = found.group(1) if found else message.split("\n", 1)[0]
    return line.strip()[:300]


_compilers: dict[int, tuple[Any, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any) -> GrammarCompiler:
    """The one compiler of ``tokenizer`` (tiers sharing a tokenizer object share their cache).

    Keyed by object identity; the tokenizer is kept alive with its entry so an id is never reused
    for another tokenizer while its compiler is cached."""
    with _compilers_lock:
        found = _compilers.get(id(tokenizer))
        if found is not None and found[0] is tokenizer:
            return found[1]
    compiler = GrammarCompiler(tokenizer)
    with _compilers_lock:
        _compilers[id(tokenizer)] = (tokenizer, compiler)
    return compiler
