"""tiers/sample/grammar.py: llguidance matchers as the engine's TokenConstraint, on the tiny test
tokenizer and on the real SmolLM2 tokenizer (tokenizer only: fast)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest
import torch

from tiers.core.constraint import TokenConstraint
from tiers.sample.grammar import GrammarCompiler, GrammarConstraint, GrammarError, GrammarSpec, compiler_for

# Every path through this schema is short (bounded strings, numbers, arrays), so a random walk
# over the allowed tokens always ends; unconstrained random tokens never make valid JSON.
BOUNDED = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["color", "ok", "count", "tag", "items"],
    "additionalProperties": False,
}


class Bounded(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    color: Literal["red", "green", "blue"]
    ok: bool
    count: int = pydantic.Field(ge=0, le=99)
    tag: str = pydantic.Field(max_length=6, pattern="^[a-z]+$")
    items: list[int] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def smol_tokenizer(embedded_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


def random_walk(con: TokenConstraint, width: int, rng: random.Random, limit: int = 400) -> list[int]:
    """What the engine does with a model that has no preference: sample uniformly among the
    tokens the mask allows until the grammar is complete."""
    mask = torch.zeros(width, dtype=torch.bool)
    out: list[int] = []
    while not con.is_terminated and len(out) < limit:
        con.fill_mask(mask)
        allowed = mask.nonzero().flatten().tolist()
        assert allowed, "a live grammar always allows some token"
        token = rng.choice(allowed)
        assert con.accept(token)
        out.append(token)
    return out


def decode(tok: Any, ids: list[int]) -> str:
    eos = set(tok.all_special_ids)
    return str(tok.decode([t for t in ids if t not in eos], skip_special_tokens=True))


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_under_schema_validates_tiny(tiny_tokenizer: Any, seed: int) -> None:
    compiler = GrammarCompiler(tiny_tokenizer)
    con = compiler.constraint(GrammarSpec.json_schema(BOUNDED))
    ids = random_walk(con, len(tiny_tokenizer) + 7, random.Random(seed))
    assert con.is_terminated
    Bounded.model_validate_json(decode(tiny_tokenizer, ids))


def test_unconstrained_random_walk_does_not_parse(tiny_tokenizer: Any) -> None:
    # The control for the test above: the same walk without a grammar is not JSON at all.
    rng = random.Random(0)
    for _ in range(5):
        text = decode(tiny_tokenizer, [rng.randrange(len(tiny_tokenizer)) for _ in range(30)])
        with pytest.raises(pydantic.ValidationError):
            Bounded.model_validate_json(text)


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_json_object_tiny(tiny_tokenizer: Any, seed: int) -> None:
    con = GrammarCompiler(tiny_tokenizer).constraint(GrammarSpec.json_object())
    # json_object is unbounded (strings can go on), so walk a fixed number of steps and then
    # follow the shortest way out: the finished prefix must always be completable.
    rng = random.Random(seed)
    mask = torch.zeros(len(tiny_tokenizer), dtype=torch.bool)
    ids = []
    for _ in range(12):
        if con.is_terminated:
            break
        con.fill_mask(mask)
        token = rng.choice(mask.nonzero().flatten().tolist())
        assert con.accept(token)
        ids.append(token)
    assert decode(tiny_tokenizer, ids).startswith("{")
    if con.is_terminated:
        assert isinstance(json.loads(decode(tiny_tokenizer, ids)), dict)


def test_mask_agrees_with_accept_and_pads_false(tiny_tokenizer: Any) -> None:
    con = GrammarCompiler(tiny_tokenizer).constraint(GrammarSpec.json_schema(BOUNDED))
    vocab = len(tiny_tokenizer)
    mask = torch.ones(vocab + 16, dtype=torch.bool)  # a padded lm head: 16 columns past the vocab
    con.fill_mask(mask)
    assert not mask[vocab:].any()
    for token in range(vocab):
        probe = GrammarCompiler(tiny_tokenizer).constraint(GrammarSpec.json_schema(BOUNDED))
        assert probe.accept(token) == bool(mask[token]), token


def test_rejected_token_leaves_state_unchanged(tiny_tokenizer: Any) -> None:
    con = GrammarCompiler(tiny_tokenizer).constraint(GrammarSpec.json_schema(BOUNDED))
    before = torch.zeros(len(tiny_tokenizer), dtype=torch.bool)
    con.fill_mask(before)
    forbidden = int((~before).nonzero()[0])
    assert not con.accept(forbidden)
    assert con.error is None
    after = torch.zeros(len(tiny_tokenizer), dtype=torch.bool)
    con.fill_mask(after)
    assert torch.equal(before, after)
    assert not con.accept(len(tiny_tokenizer) + 3)  # past the vocabulary


def test_rollback_restores_state(smol_tokenizer: Any) -> None:
    con = compiler_for(smol_tokenizer).constraint(GrammarSpec.json_schema(BOUNDED))
    doc = '{"color": "red", "ok": true, "count": 7, "tag": "abc", "items": [1, 2]}'
    ids = smol_tokenizer.encode(doc, add_special_tokens=False)
    masks = []
    for t in ids:
        m = torch.zeros(len(smol_tokenizer), dtype=torch.bool)
        con.fill_mask(m)
        masks.append(m)
        assert con.accept(t)
    assert con.is_terminated
    con.rollback(3)  # a speculative step whose last three tokens the target rejected
    assert not con.is_terminated
    m = torch.zeros(len(smol_tokenizer), dtype=torch.bool)
    con.fill_mask(m)
    assert torch.equal(m, masks[-3])
    for t in ids[-3:]:
        assert con.accept(t)
    assert con.is_terminated


def test_real_tokenizer_accepts_valid_and_rejects_invalid(smol_tokenizer: Any) -> None:
    compiler = compiler_for(smol_tokenizer)
    spec = GrammarSpec.json_schema(Bounded.model_json_schema())
    good = smol_tokenizer.encode(
        '{"color": "blue", "ok": false, "count": 42, "tag": "xyz", "items": []}', add_special_tokens=False
    )
    con = compiler.constraint(spec)
    assert all(con.accept(t) for t in good)
    assert con.is_terminated
    bad = smol_tokenizer.encode('{"color": "purple"', add_special_tokens=False)
    con = compiler.constraint(spec)
    assert not all(con.accept(t) for t in bad)


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_real_tokenizer(smol_tokenizer: Any, seed: int) -> None:
    con = compiler_for(smol_tokenizer).constraint(GrammarSpec.json_schema(BOUNDED))
    ids = random_walk(con, len(smol_tokenizer), random.Random(seed))
    Bounded.model_validate_json(decode(smol_tokenizer, ids))


def test_fork_is_independent(tiny_tokenizer: Any) -> None:
    con = GrammarCompiler(tiny_tokenizer).constraint(GrammarSpec.json_object())
    brace = tiny_tokenizer.encode("{", add_special_tokens=False)
    assert con.accept(brace[0])
    twin = con.fork()
    assert isinstance(twin, GrammarConstraint)
    assert not twin.accept(brace[0])  # "{{" is not JSON, in either copy
    assert twin.accept(tiny_tokenizer.encode("}", add_special_tokens=False)[0])
    assert twin.is_terminated and not con.is_terminated


def test_cache_by_schema_hash(tiny_tokenizer: Any) -> None:
    compiler = GrammarCompiler(tiny_tokenizer, max_entries=2)
    a = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    a_again = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    # Property order is the generation order, so it is part of the key.
    swapped = GrammarSpec.json_schema({"properties": {"y": {}, "x": {}}})
    assert a.key == a_again.key
    assert swapped.key != GrammarSpec.json_schema({"properties": {"x": {}, "y": {}}}).key
    compiler.constraint(a)
    compiler.constraint(a_again)
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.constraint(GrammarSpec.json_schema({"type": "string"}))
    compiler.constraint(GrammarSpec.json_schema({"type": "integer"}))
    compiler.constraint(a)  # evicted by the two above (LRU of 2)
    assert compiler.misses == 4
    assert compiler_for(tiny_tokenizer) is compiler_for(tiny_tokenizer)


def test_invalid_grammars_raise(tiny_tokenizer: Any) -> None:
    compiler = GrammarCompiler(tiny_tokenizer)
    with pytest.raises(GrammarError):
        compiler.validate(GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "frob"}}}))
    with pytest.raises(GrammarError):
        compiler.validate(GrammarSpec.lark("start: undefined_rule"))
    # Non-strict mode ignores keywords it cannot enforce; strict mode refuses them.
    odd = {"type": "object", "properties": {"x": {"type": "string", "not": {"const": "no"}}}}
    compiler.validate(GrammarSpec.json_schema(odd, strict=False))
    with pytest.raises(GrammarError):
        compiler.validate(GrammarSpec.json_schema(odd, strict=True))
