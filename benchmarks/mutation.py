"""Mutation score of the riskiest modules, each against only its own fast tests (``make mutation``).

The tester is mutmut 3 (chosen over cosmic-ray, both measured on ``tiers/core/block_manager.py``):
mutmut imports the code and runs the suite once, then forks one process per mutant from a warm
server and runs only the tests that reach the mutated function, switching mutants through a
trampoline in a copy of the sources; cosmic-ray rewrites the file in place and starts a fresh
test process per mutant, which here costs a torch import (seconds) per mutant and would mutate the
working tree other processes read. Each module runs in a copy of the repository under a temporary
directory, one module at a time, under ``nice``, with the property tests on a fixed, smaller set
of examples (``TIERED_ROUTER_PROPERTY_EXAMPLES``).

Results go to ``benchmarks/results/mutation.json``: per module the mutants killed (a test failed,
or the mutant ran past its timeout), survived (including mutants no selected test reached), and
equivalent - a survivor that matches an entry of ``EQUIVALENT`` below, each with the reason no
test can tell it from the original. The score is killed / (mutants - equivalent).

    python -m benchmarks.mutation                      # every module
    python -m benchmarks.mutation tiers/core/sched/scheduler.py   # some
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mutation.json"

MODULES: dict[str, list[str]] = {
    "tiers/core/block_manager.py": [
        "tests/tiers/core/test_block_manager.py",
        "tests/tiers/core/test_block_manager_properties.py",
        "tests/tiers/core/test_block_manager_edges.py",
    ],
    "tiers/core/sched/scheduler.py": [
        "tests/tiers/core/sched/test_scheduler.py",
        "tests/tiers/core/sched/test_scheduler_properties.py",
        "tests/tiers/core/sched/test_scheduler_output.py",
        "tests/tiers/core/sched/test_scheduler_edges.py",
    ],
    "tiers/spec_decode/controller.py": [
        "tests/tiers/spec_decode/test_speculative.py",
        "tests/tiers/sample/test_rejection.py",
        "tests/tiers/sample/test_sampling_speculative.py",
        "tests/tiers/spec_decode/test_controller.py",
        "-k",
        "accept_batch or controller or ngram_proposer or k_not_in_use"
        " or speculative_rule or sampling_speculative",
    ],
    "tiers/sample/rejection.py": [
        "tests/tiers/sample/test_rejection.py",
        "tests/tiers/sample/test_sampling_speculative.py",
        "tests/tiers/spec_decode/test_speculative.py",
        "-k",
        "accept_batch or speculative_rule or sampling_speculative",
    ],
    "tiers/spec_decode/ngram.py": [
        "tests/tiers/spec_decode/test_speculative.py",
        "tests/tiers/sample/test_rejection.py",
        "tests/tiers/spec_decode/test_controller.py",
        "-k",
        "ngram or speculative_rule",
    ],
    "tiers/sample/sampler.py": [
        "tests/tiers/sample/test_logits_processors.py",
        "tests/tiers/sample/test_sampling_speculative.py",
    ],
    "tiers/sample/logits_processors.py": [
        "tests/tiers/sample/test_logits_processors.py",
        "tests/tiers/sample/test_sampling_speculative.py",
    ],
    "tiers/sample/logprobs.py": [
        "tests/tiers/sample/test_logits_processors.py",
        "tests/tiers/sample/test_sampling_speculative.py",
    ],
    "router/pipeline/cache.py": [
        "tests/router/pipeline/test_cache.py",
        "tests/router/pipeline/test_cache_edges.py",
        "tests/router/pipeline/test_cache_semantic_index.py",
        "-k",
        "scope or expire or bounded or redis_entries or exact_key or lookups_report or semantic_index"
        " or build_cache or unreachable or undecodable or cache_edges",
    ],
    "router/http/auth.py": [
        "tests/router/http/test_auth.py",
        "-k",
        "x_tenant_is_ignored or keys_parse or unreadable or unit",
    ],
    "router/pipeline/admission.py": ["tests/router/pipeline/test_admission_unit.py"],
    "router/policy/decide.py": [
        "tests/router/policy/test_decide.py",
        "tests/router/policy/test_decide_edges.py",
        "tests/router/policy/test_load_aware.py",
    ],
}

# Survivors no test can tell from the original: (module, the changed source line as mutated, why).
# Matched on the mutated line, so an entry keeps applying while the code around it changes.
_UTF8 = "codec names are case-insensitive: 'UTF-8' is the same codec as 'utf-8'"
_LOCALE = (
    "encoding=None reads with the locale's encoding, UTF-8 on every host this runs on (Python 3.11 "
    "coerces the C locale to UTF-8, PEP 538); equivalent there, and only there"
)
_BM = "tiers/core/block_manager.py"
_NAMES = (
    "block names are only compared with each other inside one process (never stored or sent), so "
    "any fixed domain prefix, digest size or byte order that keeps distinct inputs distinct names "
    "the same blocks"
)
_FALSY = "OrderedDict's `last` is read for truth: None is False"
_SET = "the free queue is an OrderedDict used as an ordered set: its values are never read"
EQUIVALENT_BLOCK_MANAGER: list[tuple[str, str, str]] = [
    (
        _BM,
        'return hashlib.blake2b(parent + array("Q", tokens).tobytes(), digest_size=16).digest()',
        "token ids are never negative, so signed and unsigned 64-bit arrays give the same bytes",
    ),
    (_BM, 'return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=17).digest()', _NAMES),
    (_BM, 'return hashlib.blake2b(parent + array("q", tokens).tobytes(), ).digest()', _NAMES),
    (_BM, 'return hashlib.blake2b(b"tiered-router/kv/" + salt.encode(), ).digest()', _NAMES),
    (
        _BM,
        'return hashlib.blake2b(b"XXtiered-router/kv/XX" + salt.encode(), digest_size=16).digest()',
        _NAMES,
    ),
    (_BM, 'return hashlib.blake2b(b"TIERED-ROUTER/KV/" + salt.encode(), digest_size=16).digest()', _NAMES),
    (_BM, 'return hashlib.blake2b(b"tiered-router/kv/" + salt.encode(), digest_size=17).digest()', _NAMES),
    (_BM, "old, _ = entries.popitem(last=None)", _FALSY),
    (_BM, "self._free.move_to_end(old, last=None)  # now as worthless as any unnamed block", _FALSY),
    (_BM, "self._free.move_to_end(b, last=None)", _FALSY),
    (_BM, "b, _ = self._free.popitem(last=None)", _FALSY),
    (_BM, 'self._free[b] = ""', _SET),
    (_BM, "self._ever_used[b] = 2", "_ever_used is a bytearray read only for truth"),
    (_BM, "for a, b in zip(tokens, want, strict=None):", "zip's strict defaults to False; None is False"),
    (_BM, "for a, b in zip(tokens, want, ):", "zip's strict defaults to False"),
    (
        _BM,
        "if not self.enable_caching and self.copy_block is None:",
        "with caching off nothing is ever indexed (cache_full_blocks and _remember_partial return "
        "first), so the lookup finds no entry and returns None either way",
    ),
    (
        _BM,
        "if best is None or n >= best[1]:",
        "blocks that tie serve the same run of tokens after the same parent: either copy is the same KV",
    ),
    (
        _BM,
        "if best is None and best[1] == 0:",
        "entries are keyed by the first wanted token and `want` is non-empty (limit > start), so the "
        "first entry sets best with n >= 1: best is never None and never serves 0 tokens here",
    ),
    (
        _BM,
        "if self.ref_counts[b] != 1 or b in self._name_of and b in self._indexed:",
        "a named block is always indexed (cache_full_blocks indexes what it names; without copy_block "
        "_remember_partial returned earlier) and an indexed unnamed block is free, never in a table",
    ),
    (
        _BM,
        "tail = BlockTable(None, table.blocks[keep:], [])",
        "free() without token_ids reads neither the tail's salt nor its names",
    ),
    (
        _BM,
        "tail = BlockTable(table.salt, table.blocks[keep:], )",
        "free() without token_ids reads neither the tail's salt nor its names",
    ),
]
_DECIDE = "router/policy/decide.py"
_GET_NONE = "Mapping.get without a default returns None, which is as falsy as the False default"
_UNREACHABLE_DEFAULT = (
    "the for-else runs only when no rule matches; the loader requires the last rule to have no "
    "'when' (the default rule), so a validated policy never gets there"
)
_NO_PROBABILITIES = (
    "the loader keeps every confidence threshold in [0, 1], and a score without probabilities is "
    "fully confident under either default (1.0 or 2.0 is never below a threshold <= 1)"
)
EQUIVALENT_DECIDE: list[tuple[str, str, str]] = [
    (_DECIDE, "if t in costs and not full.get(t, None) and not _cap(policy, t, tenant)[1]", _GET_NONE),
    (_DECIDE, "if t in costs and not full.get(t, ) and not _cap(policy, t, tenant)[1]", _GET_NONE),
    (_DECIDE, "while full.get(tier, None):", _GET_NONE),
    (_DECIDE, "while full.get(tier, ):", _GET_NONE),
    (
        _DECIDE,
        "below = [t for t in ordered if order.index(t) <= order.index(tier)]",
        "_cap returns earlier when the tier is allowed, so no allowed tier sits at the tier's own index",
    ),
    (
        _DECIDE,
        "cfg = policy.tenants.get(tenant) if (tenant is not None) or True else None",
        "tenants are keyed by strings (the loader refuses other keys): tenants.get(None) is None either way",
    ),
    (_DECIDE, "confidence = max(score.probabilities.values(), default=2.0)", _NO_PROBABILITIES),
    (
        _DECIDE,
        "and not max(score.probabilities.values(), default=2.0) < w.confidence_below",
        _NO_PROBABILITIES,
    ),
    (_DECIDE, "tier, rule, reason, used_score = None", _UNREACHABLE_DEFAULT),
    (_DECIDE, "policy.tier_names[+1],", _UNREACHABLE_DEFAULT),
    (_DECIDE, "policy.tier_names[-2],", _UNREACHABLE_DEFAULT),
    (_DECIDE, '"XXimplicit-defaultXX",', _UNREACHABLE_DEFAULT),
    (_DECIDE, '"IMPLICIT-DEFAULT",', _UNREACHABLE_DEFAULT),
    (_DECIDE, '"XXno rule matchedXX",', _UNREACHABLE_DEFAULT),
    (_DECIDE, '"NO RULE MATCHED",', _UNREACHABLE_DEFAULT),
    (_DECIDE, "True,", _UNREACHABLE_DEFAULT),
    (
        _DECIDE,
        "if pin or order.index(session) >= order.index(tier):",
        "the enclosing test already requires session != tier, so the indices are never equal here",
    ),
]
_CACHE = "router/pipeline/cache.py"
_SAME_DIGEST = (
    "keys are digests compared only with digests from the same function: escaping non-ASCII or "
    "naming the semantic domain differently changes every key alike (an exact key and a scope "
    "already differ in their parts' structure)"
)
_FLOAT_ROWS = (
    "the semantic matrix's dtype and initial size change neither which row is most similar nor "
    "whether it clears the threshold (rows are unit vectors; the matrix grows on demand)"
)
EQUIVALENT_CACHE: list[tuple[str, str, str]] = [
    (_CACHE, "raw = json.dumps(parts, sort_keys=True, ensure_ascii=True, default=str)", _SAME_DIGEST),
    (_CACHE, "raw = json.dumps(parts, sort_keys=True, ensure_ascii=None, default=str)", _SAME_DIGEST),
    (_CACHE, "raw = json.dumps(parts, sort_keys=True, default=str)", _SAME_DIGEST),
    (_CACHE, 'scope = _digest([*head, "XXsemanticXX", earlier])', _SAME_DIGEST),
    (_CACHE, 'scope = _digest([*head, "SEMANTIC", earlier])', _SAME_DIGEST),
    (_CACHE, 'scope = _digest([*head, "XXsemanticXX"])', _SAME_DIGEST),
    (_CACHE, 'scope = _digest([*head, "SEMANTIC"])', _SAME_DIGEST),
    (_CACHE, "self._data.popitem(last=None)", _FALSY),
    (
        _CACHE,
        "earlier = content[:-1] if (isinstance(content, list)) or True else None",
        "a chat request's messages are always a list (the schema requires it)",
    ),
    (
        _CACHE,
        'elif gen.kind == "completion" or gen.prompt:',
        "a chat Generation has no prompt, so the branch is taken for completions only either way",
    ),
    (
        _CACHE,
        "content = fields.pop(content_field, )",
        "the content field is always present (chat requires messages, completions a prompt)",
    ),
    (_CACHE, "self.matrix = np.zeros((8, dim), dtype=None)", _FLOAT_ROWS),
    (_CACHE, "self.matrix = np.zeros((8, dim), )", _FLOAT_ROWS),
    (_CACHE, "self.matrix = np.zeros((9, dim), dtype=np.float32)", _FLOAT_ROWS),
    (_CACHE, "self.expires = np.zeros(8, dtype=None)", _FLOAT_ROWS),
    (_CACHE, "self.expires = np.zeros(8, )", _FLOAT_ROWS),
    (_CACHE, "self.expires = np.zeros(9, dtype=np.float64)", _FLOAT_ROWS),
    (_CACHE, "sims = self.matrix[:n] @ vector.astype(None, copy=False)", _FLOAT_ROWS),
    (_CACHE, "sims = self.matrix[:n] @ vector.astype(self._np.float32, copy=None)", _FLOAT_ROWS),
    (_CACHE, "sims = self.matrix[:n] @ vector.astype(self._np.float32, )", _FLOAT_ROWS),
    (_CACHE, "sims = self.matrix[:n] @ vector.astype(self._np.float32, copy=True)", _FLOAT_ROWS),
    (
        _CACHE,
        "too_long = len(text) >= MAX_TOKENS and len(text.split(maxsplit=MAX_TOKENS)) > MAX_TOKENS",
        "a text of exactly MAX_TOKENS characters holds at most MAX_TOKENS/2 + 1 words, so the word "
        "test is false there either way",
    ),
    (
        _CACHE,
        "self._skip_until = 1.0",
        "time.monotonic() counts from boot on Linux; a service answers requests long after the "
        "first second, where 0.0 and 1.0 both lie in the past",
    ),
    (
        _CACHE,
        "n = None",
        "the extra rows are zeros (similarity 0) and the loader keeps the threshold in (0, 1]: an "
        "unused row is never the answer, and a live row clears the threshold or nothing does",
    ),
]
_SA = "tiers/sample/sampler.py"
_DIM = "the tensor is [rows, V] (2-D): dim +1 is dim -1"
_INF = 'float() parses "inf" case-insensitively: "-INF" is -inf'
_F32 = (
    "torch's default dtype is float32, the dtype of every logits tensor the runner hands the "
    "sampler: the same tensor there (only a float64 caller could tell)"
)
_GREEDY = (
    "greedy rows' laws are replaced by the one-hot at their raw argmax at the end, whatever "
    "temperature, top-k, top-p or min-p they went through"
)
_TOP_K_OFF = (
    "top_k = 1 is greedy, 0 and >= vocab keep every token (ks = vocab drops none): the filter only "
    "changes rows with 1 < top_k < vocab"
)
_IDENTITY = "the sort/scatter round trip without a drop is an exact identity"
_RENORM = (
    "dividing a softmax output by its own sum (~1) moves it by float rounding only, below what "
    "any draw or comparison resolves"
)
_TOPK_ZIP = "torch.topk returns values and ids of one length: zip's strict check never fires"
EQUIVALENT_SAMPLING: list[tuple[str, str, str]] = [
    (_SA, "alternatives = [(int(t), float(v)) for t, v in zip(ids, values, strict=None)]", _TOPK_ZIP),
    (_SA, 'pad = torch.full((logits.shape[0], vocab - logits.shape[1]), float("-INF"))', _INF),
    (_SA, "if logits.shape[1] <= vocab:", "at equal widths the pad has no columns: cat adds nothing"),
    (_SA, "tokens = logits.argmax(dim=+1)", _DIM),
    (_SA, "drop |= ((sorted_p.cumsum(dim=+1) - sorted_p) >= tp) & (tp < 1.0)", _DIM),
    (_SA, 'row.masked_fill_(~mask, float("-INF"))', _INF),
    (
        _SA,
        "None",
        "apply_penalties' counts.to(None) keeps int64 counts: penalty * counts gives the same floats",
    ),
    (
        _SA,
        "logprobs = torch.log_softmax(flat, dim=+1)"
        " if any(s.params.logprobs is not None for s in seqs) else None",
        _DIM,
    ),
    (_SA, "argmax = flat.argmax(dim=+1).tolist()", _DIM),
    (_SA, "tokens = [1] * len(seqs)", "every row's entry is written below before it is read"),
    (
        _SA,
        "d_num = torch.zeros(len(spec), dtype=None)",
        "draft counts are small integers, exact in float32, and only compared (never used as indices)",
    ),
    (
        _SA,
        "d_num = torch.zeros(len(spec), )",
        "draft counts are small integers, exact in float32, and only compared (never used as indices)",
    ),
    (
        _SA,
        "q = torch.zeros((len(spec), k + 2, vocab))",
        "accept_batch reads target laws at positions 0..k only: an extra zero position is never read",
    ),
    (_SA, "alternatives = [(int(t), float(v)) for t, v in zip(ids, values, )]", _TOPK_ZIP),
    (_SA, "alternatives = [(int(t), float(v)) for t, v in zip(ids, values, strict=False)]", _TOPK_ZIP),
    (_SA, "if not c.is_contiguous() or c.dim() != 2 or c.shape[+1] != width or c.data_ptr() != nxt:", _DIM),
    (_SA, "width = first.shape[+1]", _DIM + " (chunks are [m, V]; a non-2-D first chunk is copied anyway)"),
    (
        _SA,
        "return first.as_strided((total, width), (width, 1), None)",
        "as_strided's storage_offset=None keeps the input's own offset: first.storage_offset()",
    ),
    (
        _SA,
        "return first.as_strided((total, width), (width, 1), )",
        "as_strided's storage_offset defaults to the input's own offset: first.storage_offset()",
    ),
    (_SA, "vocab = logits.shape[+1]", _DIM),
    (
        _SA,
        "logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(None)",
        "to(None) keeps the bool tensor, and float * bool gives the same values as float * float",
    ),
    (
        _SA,
        "ids = torch.tensor(list(prompt_ids) + list(output_ids), dtype=None)",
        "the list holds ints and is never empty (a Sequence refuses an empty prompt): int64 either way",
    ),
    (
        _SA,
        "ids = torch.tensor(list(prompt_ids) + list(output_ids), )",
        "the list holds ints and is never empty (a Sequence refuses an empty prompt): int64 either way",
    ),
    (
        _SA,
        "logits >= 0, logits / params.repetition_penalty, logits * params.repetition_penalty",
        "at 0 both branches give 0",
    ),
    (_SA, "return (probs / noise.clamp_(min=1e-20)).argmax(dim=+1)", _DIM),
    (_SA, "probs = x.softmax(dim=+1)", _DIM),
    (_SA, "onehot = torch.zeros_like(probs).scatter_(+1, logits.argmax(dim=-1, keepdim=True), 1.0)", _DIM),
    (_SA, "onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=+1, keepdim=True), 1.0)", _DIM),
    (_SA, "sorted_x, order = torch.sort(x, dim=+1, descending=True)", _DIM),
    (_SA, "sorted_x, order = torch.sort(x, descending=True)", "torch.sort's dim defaults to -1"),
    (_SA, 'sorted_p = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=+1)', _DIM),
    (_SA, 'sorted_p = sorted_x.masked_fill(drop, float("-INF")).softmax(dim=-1)', _INF),
    (_SA, 'x = x.scatter(+1, order, sorted_x.masked_fill(drop, float("-inf")))', _DIM),
    (_SA, 'x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-INF")))', _INF),
    (_SA, "keep = probs >= min_p[:, None] * probs.amax(dim=+1, keepdim=True)", _DIM),
    (_SA, "probs = probs / probs.sum(dim=+1, keepdim=True)", _DIM),
    (_SA, 'lg[j].masked_fill_(~m, float("-INF"))', _INF),
    (
        _SA,
        "temps = torch.tensor([p.temperature if (not p.is_greedy) or True else 1.0"
        " for p in params], dtype=logits.dtype)",
        _GREEDY,
    ),
    (
        _SA,
        "temps = torch.tensor([p.temperature if not p.is_greedy else 2.0"
        " for p in params], dtype=logits.dtype)",
        _GREEDY,
    ),
    (_SA, "top_p = [p.top_p if (not p.is_greedy) or True else 1.0 for p in params]", _GREEDY),
    (_SA, "top_p = [p.top_p if not p.is_greedy else 2.0 for p in params]", _GREEDY),
    (
        _SA,
        "min_p = torch.tensor([p.min_p if (not p.is_greedy) or True else 0.0"
        " for p in params], dtype=probs.dtype)",
        _GREEDY + "; rows at min_p = 0 are only renormalised: " + _RENORM,
    ),
    (
        _SA,
        "min_p = torch.tensor([p.min_p if not p.is_greedy else 1.0 for p in params], dtype=probs.dtype)",
        _GREEDY + "; rows at min_p = 0 are only renormalised: " + _RENORM,
    ),
    (
        _SA,
        "if bool((min_p >= 0).any()):",
        "rows at min_p = 0 keep every token and are only renormalised: " + _RENORM,
    ),
    (
        _SA,
        "top_k = [p.top_k if (0 < p.top_k < vocab and not p.is_greedy) or True else 0 for p in params]",
        _TOP_K_OFF + "; " + _GREEDY,
    ),
    (_SA, "top_k = [p.top_k if 0 < p.top_k < vocab or not p.is_greedy else 0 for p in params]", _TOP_K_OFF),
    (_SA, "top_k = [p.top_k if 1 < p.top_k < vocab and not p.is_greedy else 0 for p in params]", _TOP_K_OFF),
    (_SA, "top_k = [p.top_k if 0 <= p.top_k < vocab and not p.is_greedy else 0 for p in params]", _TOP_K_OFF),
    (_SA, "top_k = [p.top_k if 0 < p.top_k <= vocab and not p.is_greedy else 0 for p in params]", _TOP_K_OFF),
    (_SA, "if any(top_k) or any(tp <= 1.0 for tp in top_p):", _IDENTITY),
    (_SA, "if any(top_k) or any(tp < 2.0 for tp in top_p):", _IDENTITY),
    (
        _SA,
        "if any(tp <= 1.0 for tp in top_p):",
        "rows at top_p = 1 drop nothing (the `& (tp < 1.0)` guard): " + _IDENTITY,
    ),
    (
        _SA,
        "if any(tp < 2.0 for tp in top_p):",
        "rows at top_p = 1 drop nothing (the `& (tp < 1.0)` guard): " + _IDENTITY,
    ),
    (
        _SA,
        "drop = torch.arange(vocab)[None, :] >= ks[:, None]",
        "drop is all False just before: = and |= agree",
    ),
    (
        _SA,
        "temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], dtype=None)",
        _F32,
    ),
    (_SA, "temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], )", _F32),
    (_SA, "min_p = torch.tensor([p.min_p if not p.is_greedy else 0.0 for p in params], dtype=None)", _F32),
    (_SA, "min_p = torch.tensor([p.min_p if not p.is_greedy else 0.0 for p in params], )", _F32),
    (_SA, "tp = torch.tensor(top_p, dtype=None)[:, None]", _F32),
    (_SA, "tp = torch.tensor(top_p, )[:, None]", _F32),
    (
        _SA,
        "values = torch.tensor([b for t, b in bias if 0 <= t < vocab], dtype=None)",
        _F32,
    ),
    (_SA, "values = torch.tensor([b for t, b in bias if 0 <= t < vocab], )", _F32),
    (
        _SA,
        "block = torch.empty((len(unseeded), probs.shape[1]), dtype=None).exponential_(generator=shared)",
        _F32,
    ),
    (_SA, "block = torch.empty((len(unseeded), probs.shape[1]), ).exponential_(generator=shared)", _F32),
]
_SC = "tiers/core/sched/scheduler.py"
_ROWS = (
    "batch.seqs and batch.num_new_tokens are only ever appended together (_add_row): equal "
    "lengths, strict never fires"
)
_DECODES = "1 for s, n in zip(batch.seqs, batch.num_new_tokens, {}) if n == 1 and s.is_decoding"
EQUIVALENT_SCHEDULER: list[tuple[str, str, str]] = [
    (
        _SC,
        "1 for s, n in zip(batch.seqs, batch.num_new_tokens, strict=None) if n == 1 and s.is_decoding",
        _ROWS,
    ),
    (_SC, "1 for s, n in zip(batch.seqs, batch.num_new_tokens, ) if n == 1 and s.is_decoding", _ROWS),
    (
        _SC,
        "1 for s, n in zip(batch.seqs, batch.num_new_tokens, strict=False) if n == 1 and s.is_decoding",
        _ROWS,
    ),
    (_SC, "if n >= 1 and contended:", "at n = 1 the cap gives min(1, max(1, budget // 2)) = 1: unchanged"),
    (
        _SC,
        "want = self._spec_wanted(seq) if (n == 1) or True else 0",
        "n > 1 means the sequence is more than one token behind, not decoding: _spec_wanted returns 0",
    ),
]
_SP = "tiers/spec_decode/controller.py"
_NG = "tiers/spec_decode/ngram.py"
_KNOT = "at a knot both neighbouring segments give the knot's own value"
_DISTINCT = "the points' x are distinct (dict keys, a set of batch sizes): x1 != x0 always"
_RATE = (
    "every rate here is a positive float (choose_k returned max_k if any was None; a rate is "
    "tokens over a cost floored above 0): the `or` default is never used"
)
_INDEX = (
    "the n-gram index is a cache: rebuilding it, or indexing again positions already indexed, "
    "gives the same tables (the latest occurrence written last), so the same proposal"
)
_NGRAM_KEY = "only n-grams of length n are ever looked up; a key of another length is never found"
_RATIO = "a ratio from a non-empty table (ratios hold the plain points) is never None"
_K0 = "at k = 0 the draft's cost is multiplied by 0"
EQUIVALENT_SPECULATIVE: list[tuple[str, str, str]] = [
    (
        _SP,
        "num_accepted = torch.cumprod(ok.to(None), dim=1).sum(dim=1)  # [R]",
        "cumprod of a bool tensor promotes to int64: the same counts",
    ),
    (
        _SP,
        "at = num_accepted.clamp(max=k - 1) if (k) or True else num_accepted",
        "`at` is read only when k > 0",
    ),
    (_SP, "total = residual.sum(dim=+1, keepdim=True)", "residual is [R, V] (2-D): dim +1 is dim -1"),
    (
        _SP,
        "def choose_k(self, batch_size: int, draft_lag: int = 2) -> int:",
        "draft_lag is only compared with <= 2 and <= 8: 1 and 2 fall on the same side of both",
    ),
    (
        _NG,
        "self.blocks = BlockManager(num_blocks, block_size, enable_caching=None)",
        "enable_caching is only read for truth: None is False",
    ),
    (_NG, "if k < 0:", "k = 0 slices an empty proposal; " + _INDEX),
    (_NG, "idx = None", _INDEX),
    (_NG, "idx = self._index.get(None)", _INDEX),
    (_NG, "if idx is None or idx.length >= len(tokens):  # new, or tokens were rolled back", _INDEX),
    (
        _NG,
        "idx = self._index[seq_id] = _NgramIndex(1, [{} for _ in range(self.max_n - self.min_n + 1)])",
        "indexing starts at max(0, length - 1): 0 for a length of 0 or 1",
    ),
    (_NG, "for e in range(end):", _INDEX),
    (_NG, "for e in range(max(0, idx.length - 2), end):", _INDEX),
    (_NG, "if e + 2 >= n:", "the extra e = n - 2 slices tokens[-1:n - 1], empty: " + _NGRAM_KEY),
    (
        _NG,
        "for i in range(len(idx.last) - 1, -2, -1):",
        "i = -1 looks up min_n - 1 tokens in the max_n table: " + _NGRAM_KEY,
    ),
    (
        _NG,
        "if len(tokens) <= n:",
        "with exactly n tokens no earlier n-gram has a token after it: nothing is found either way",
    ),
    (_SP, "if x < points[0][0]:", _KNOT),
    (_SP, "if x <= points[1][0]:", "x up to the second point lies on the first segment: " + _KNOT),
    (_SP, "elif x > points[-1][0]:", _KNOT),
    (_SP, "elif x >= points[-2][0]:", "x from the second-last point on lies on the last segment: " + _KNOT),
    (
        _SP,
        "(x0, y0), (x1, y1) = next((a, b) for a, b in itertools.pairwise(points) if a[0] < x <= b[0])",
        _KNOT,
    ),
    (
        _SP,
        "(x0, y0), (x1, y1) = next((a, b) for a, b in itertools.pairwise(points) if a[0] <= x < b[0])",
        _KNOT,
    ),
    (_SP, "y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if (x1 != x0) or True else y0", _DISTINCT),
    (
        _SP,
        "if tokens == 1 or plain is None and not self.target_ratio:",
        "a ratio is recorded only where a plain step was measured: plain is never None while "
        "target_ratio is non-empty",
    ),
    (_SP, "return None if (ratio is None) and False else plain * ratio", _RATIO),
    (_SP, "draft = self._draft(batch_size) if k else 1.0", _K0),
    (
        _SP,
        "and rounds[best][1] / rounds[best][0] < SPEC_MARGIN / rounds[0][1] / rounds[0][0]",
        "k = 0's tokens are (1 - a) / (1 - a) = 1.0 exactly: * and / by it agree",
    ),
    (_SP, "best = max(rates, key=lambda k: rates[k] or 1.0)", _RATE),
    (_SP, "if best and (rates[best] or 1.0) < margin * (rates[0] or 0.0):", _RATE),
    (_SP, "if best and (rates[best] or 0.0) < margin * (rates[0] or 1.0):", _RATE),
    (_SP, "return max(range(1, self.max_k + 1), key=lambda k: rates[k] or 1.0)", _RATE),
    (
        _SP,
        "self.expected_rate(k, batch_size, acceptance=0.999) or 1.0 for k in range(1, self.max_k + 1)",
        _RATE,
    ),
    (_SP, "and ceiling > (rates[0] or 1.0)", _RATE),
    (
        _SP,
        "self.expected_rate(k, batch_size, acceptance=1.999) or 0.0 for k in range(1, self.max_k + 1)",
        "expected_rate caps the acceptance at 0.999",
    ),
    (
        _SP,
        "self.expected_rate(k, batch_size, acceptance=0.999) or 0.0 for k in range(self.max_k + 1)",
        "k = 0 adds rates[0] itself to the ceiling, which is never > rates[0]",
    ),
]
EQUIVALENT: list[tuple[str, str, str]] = [
    *EQUIVALENT_BLOCK_MANAGER,
    *EQUIVALENT_SCHEDULER,
    *EQUIVALENT_SPECULATIVE,
    *EQUIVALENT_SAMPLING,
    *EQUIVALENT_DECIDE,
    *EQUIVALENT_CACHE,
    (
        "router/http/auth.py",
        'found = ApiKeys.parse(Path(auth.api_keys_file).read_text(encoding="UTF-8"))',
        _UTF8,
    ),
    ("router/http/auth.py", 'return Path(self.config.api_keys_file).read_text(encoding="UTF-8")', _UTF8),
    (
        "router/http/auth.py",
        "found = ApiKeys.parse(Path(auth.api_keys_file).read_text(encoding=None))",
        _LOCALE,
    ),
    ("router/http/auth.py", "return Path(self.config.api_keys_file).read_text(encoding=None)", _LOCALE),
    (
        "router/http/auth.py",
        'authorization = "bearer " + headers["x-api-key"]',
        "the scheme is compared lower-cased (ApiKeys.lookup): 'bearer' is 'Bearer'",
    ),
    (
        "router/http/auth.py",
        'authorization = "BEARER " + headers["x-api-key"]',
        "the scheme is compared lower-cased (ApiKeys.lookup): 'BEARER' is 'Bearer'",
    ),
    (
        "router/pipeline/admission.py",
        "wait = p.wait_s if p is not None else 1.0",
        "only read as max(1.0, ceil(wait)): 0.0 and 1.0 both give a Retry-After of 1 s",
    ),
    (
        "router/pipeline/admission.py",
        "cfg = policy.tenants.get(tenant) if (tenant is not None) or True else None",
        "tenants are keyed by strings (the loader refuses other keys): tenants.get(None) is None either way",
    ),
    (
        "router/pipeline/admission.py",
        'wait = float(getattr(load, "predicted_wait_s", None) or 0.0)',
        "a load without the field gives None instead of 0.0, and `or 0.0` makes both 0.0",
    ),
]

STATUS = {1: "killed", 3: "killed", 36: "killed", 24: "killed", -24: "killed", 152: "killed", 255: "killed"}
"""mutmut exit codes: 1/3 a test failed; 36, 24, 152, 255 the timeout (a mutant that loops forever
is detected). Everything else - 0 (tests passed), 33/5 (no test reached it) - is a survivor."""


_COPIED = ("router", "tiers", "classifier", "tests", "pyproject.toml")


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _copy_repo(dest: Path, *, worktree: bool = False) -> None:
    """The committed tree (HEAD) by default: in a shared working tree another change in progress
    would otherwise be measured with the module (``worktree=True`` copies the files as they are)."""
    dest.mkdir(parents=True, exist_ok=True)
    if not worktree:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", "HEAD", *_COPIED], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc", "mutants")
    for name in _COPIED[:-1]:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _config(module: str, tests: list[str]) -> str:
    package = module.split("/", maxsplit=1)[0]
    others = [p for p in ("router", "tiers", "classifier") if p != package]
    args = ["-p", "no:cacheprovider", "-q", "-x", "-p", "no:randomly"]
    return (
        "\n[tool.mutmut]\n"
        f"source_paths = [{json.dumps(package)}]\n"
        f"only_mutate = [{json.dumps(module)}]\n"
        f"also_copy = {json.dumps(others)}\n"
        f"pytest_add_cli_args = {json.dumps(args)}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )


def _changed_line(diff: str) -> str:
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return plus[0] if plus else ""


def _equivalent_reason(module: str, line: str) -> str | None:
    return next((why for mod, mutated, why in EQUIVALENT if mod == module and mutated == line), None)


def reclassify(res: dict[str, Any], module: str) -> dict[str, Any]:
    """Apply today's ``EQUIVALENT`` to a module's recorded survivors and equivalents (no mutmut
    run): what a new entry, or one that no longer applies, does to the score."""
    survived, equivalent = [], []
    for entry in [*res["survivors"], *res["equivalents"]]:
        plain = {k: v for k, v in entry.items() if k != "reason"}
        reason = _equivalent_reason(module, plain["mutated_line"])
        if reason is None:
            survived.append(plain)
        else:
            equivalent.append({**plain, "reason": reason})
    scored = res["mutants"] - len(equivalent)
    return {
        **res,
        "survived": len(survived),
        "equivalent": len(equivalent),
        "score": round(res["killed"] / scored, 4) if scored else None,
        "survivors": survived,
        "equivalents": equivalent,
    }


def run_module(
    module: str,
    tests: list[str],
    *,
    examples: int,
    children: int,
    timeout_s: float,
    workdir: Path | None = None,
    worktree: bool = False,
) -> dict[str, Any]:
    """``workdir``: the copy lives there and is kept; a run over an existing copy resumes (mutmut
    skips the mutants it has results for), so a run cut off by the timeout loses nothing."""
    mutmut = Path(sys.executable).with_name("mutmut")
    with tempfile.TemporaryDirectory(prefix="tiered-router-mutation-") as tmp:
        work = Path(tmp) if workdir is None else workdir / module.replace("/", "_")
        if not (work / "pyproject.toml").is_file():
            _copy_repo(work, worktree=worktree)
            (work / "MEASURED_COMMIT").write_text("working tree" if worktree else _head())
            with (work / "pyproject.toml").open("a") as fh:
                fh.write(_config(module, tests))
        env = {**os.environ, "TIERED_ROUTER_PROPERTY_EXAMPLES": str(examples), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.monotonic()
        proc = subprocess.run(
            ["nice", "-n", "10", str(mutmut), "run", "--max-children", str(children)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        seconds = time.monotonic() - started
        meta_path = work / "mutants" / (module + ".meta")
        if not meta_path.is_file():
            raise RuntimeError(
                f"mutmut produced no results for {module}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        codes: dict[str, int | None] = json.loads(meta_path.read_text())["exit_code_by_key"]
        commit = (work / "MEASURED_COMMIT").read_text() if (work / "MEASURED_COMMIT").is_file() else None
        killed, survived, equivalent = [], [], []
        for key, code in sorted(codes.items()):
            if code in STATUS:
                killed.append(key)
                continue
            shown = subprocess.run(
                [str(mutmut), "show", key], cwd=work, env=env, capture_output=True, text=True, check=False
            ).stdout
            line = _changed_line(shown)
            reason = _equivalent_reason(module, line)
            entry = {"mutant": key, "exit_code": code, "mutated_line": line, "diff": shown.strip()}
            if reason is not None:
                equivalent.append({**entry, "reason": reason})
            else:
                survived.append(entry)
    scored = len(codes) - len(equivalent)
    return {
        "tests": tests,
        "commit": commit,
        "mutants": len(codes),
        "killed": len(killed),
        "survived": len(survived),
        "equivalent": len(equivalent),
        "score": round(len(killed) / scored, 4) if scored else None,
        "seconds": round(seconds, 1),
        "survivors": survived,
        "equivalents": equivalent,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("modules", nargs="*", help="modules to run (default: all)")
    parser.add_argument("--examples", type=int, default=25, help="Hypothesis examples per property test")
    parser.add_argument("--children", type=int, default=2, help="mutants run at once")
    parser.add_argument("--timeout-s", type=float, default=2400.0, help="bound on one module's run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--workdir", type=Path, help="keep each module's copy under this folder; a rerun resumes it"
    )
    parser.add_argument(
        "--worktree",
        action="store_true",
        help="mutate the working tree's files as they are (default: the committed tree, HEAD)",
    )
    parser.add_argument(
        "--reclassify",
        action="store_true",
        help="re-apply EQUIVALENT to the results already in --out (no mutmut run)",
    )
    args = parser.parse_args(argv)
    modules = args.modules or list(MODULES)
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.setdefault("modules", {})
    if args.reclassify:
        for module in modules:
            if module in results["modules"]:
                res = results["modules"][module] = reclassify(results["modules"][module], module)
                print(
                    f"{module}: {res['survived']} survived, {res['equivalent']} equivalent: "
                    f"score {res['score']}"
                )
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        return 0
    for module in modules:
        print(f"{module}: mutating...", flush=True)
        res = run_module(
            module,
            MODULES[module],
            examples=args.examples,
            children=args.children,
            timeout_s=args.timeout_s,
            workdir=args.workdir,
            worktree=args.worktree,
        )
        results["modules"][module] = res
        print(
            f"{module}: {res['mutants']} mutants, {res['killed']} killed, {res['survived']} survived, "
            f"{res['equivalent']} equivalent: score {res['score']} ({res['seconds']} s)",
            flush=True,
        )
        results["tool"] = (
            "mutmut 3 ("
            + subprocess.run(
                [str(Path(sys.executable).with_name("mutmut")), "--version"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            + ")"
        )
        results["target"] = ">= 0.90 of non-equivalent mutants killed in each module"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    low = [m for m in modules if (results["modules"][m]["score"] or 0.0) < 0.9]
    if low:
        print("below 0.90: " + ", ".join(low))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
