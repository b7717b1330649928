"""router/policy/checks.py: the cross-field checks of a parsed policy - each bound accepted at its
limit and refused one past it with a message naming the field path, names safe for headers,
drafts and draft cycles, aliases, fallbacks, tenants, service settings, rule order and
reachability, and ``subsumes``.

The reference is each field's documented range (schema docstrings, README's policy reference),
worked by hand at the boundary; expected messages are written out in full. Policies are built as
plain data from a small valid three-tier policy, dumped to YAML and parsed with ``parse_policy``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from router.errors import PolicyError
from router.policy.checks import subsumes
from router.policy.loader import parse_policy
from router.policy.schema import Condition, Policy

MODEL = "embedded:smollm2-135m-instruct"
BASE: dict[str, Any] = {
    "tiers": {
        "small": {"model": MODEL},
        "medium": {"model": MODEL, "draft": "small"},
        "large": {"model": MODEL, "draft": "medium"},
    },
    "routing": {
        "rules": [
            {"name": "s", "when": {"score_below": 0.3}, "tier": "small"},
            {"name": "m", "when": {"score_below": 0.6}, "tier": "medium"},
            {"name": "default", "tier": "large"},
        ]
    },
}
REMOTE = "http://vllm:8000/v1"


def build(edits: dict[str, Any] | None = None, **top: Any) -> str:
    """BASE with ``edits`` applied (dotted paths, list indices as numbers) and ``top`` sections set."""
    data = copy.deepcopy(BASE)
    data.update(top)
    for dotted, value in (edits or {}).items():
        *parents, last = dotted.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return yaml.safe_dump(data, sort_keys=False)


def accepted(edits: dict[str, Any] | None = None, **top: Any) -> Policy:
    return parse_policy(build(edits, **top), "p.yaml")


def refused(edits: dict[str, Any] | None = None, **top: Any) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(build(edits, **top), "p.yaml")
    return [(i.path, i.message) for i in info.value.issues]


def rules(*rs: dict[str, Any]) -> dict[str, Any]:
    return {"routing.rules": list(rs)}


def test_the_base_policy_is_valid() -> None:
    """Bug it catches: any check that refuses an ordinary valid policy (a flipped comparison on a
    default value, a draft chain read as a cycle, ordered score rules read as out of order)."""
    p = accepted()
    assert p.tier_names == ["small", "medium", "large"]


# -- tiers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "minimum"),
    [
        ("max_num_seqs", 1),
        ("max_queue", 0),
        ("max_model_len", 16),
        ("max_num_batched_tokens", 16),
        ("speculative_tokens", 0),
        ("kv_cache_tokens", 16),
        ("max_retries", 0),
        ("circuit_failures", 1),
    ],
)
def test_tier_integer_minimums(field: str, minimum: int) -> None:
    """Bug it catches: an off-by-one minimum (``max_model_len`` 17 or 15, ``max_queue`` 1), ``<=``
    for ``<`` (the minimum itself refused), or a field dropped from the list (0 sequences load)."""
    edit = {f"tiers.small.{field}": minimum}
    if field == "max_num_batched_tokens":
        edit["tiers.small.max_num_seqs"] = 1
    assert getattr(accepted(edit).tiers["small"], field) == minimum
    edit[f"tiers.small.{field}"] = minimum - 1
    found = refused(edit)
    assert (f"tiers.small.{field}", f"must be >= {minimum}, got {minimum - 1}") in found, found


def test_a_prefill_budget_below_the_batch_is_refused() -> None:
    """Bug it catches: ``<=`` for ``<`` (equal budget and batch refused) or the check dropped (a
    running sequence could not get its token each step)."""
    ok = accepted({"tiers.small.max_num_seqs": 32, "tiers.small.max_num_batched_tokens": 32})
    assert ok.tiers["small"].max_num_batched_tokens == 32
    found = refused({"tiers.small.max_num_seqs": 32, "tiers.small.max_num_batched_tokens": 31})
    assert found == [
        (
            "tiers.small.max_num_batched_tokens",
            "must be >= max_num_seqs (32): each running sequence needs a token a step",
        )
    ]


@pytest.mark.parametrize("size", [8, 16, 32, 64, 128])
def test_each_documented_block_size_is_accepted(size: int) -> None:
    """Bug it catches: a block size dropped from (8, 16, 32, 64, 128)."""
    assert accepted({"tiers.small.block_size": size}).tiers["small"].block_size == size


@pytest.mark.parametrize("size", [4, 12, 256])
def test_other_block_sizes_are_refused(size: int) -> None:
    """Bug it catches: the block size check dropped or widened."""
    assert refused({"tiers.small.block_size": size}) == [
        ("tiers.small.block_size", f"must be 8, 16, 32, 64 or 128, got {size}")
    ]


@pytest.mark.parametrize("size", [32, 64, 128])
def test_each_int4_group_size_is_accepted(size: int) -> None:
    """Bug it catches: a documented ``quant_group_size`` (32, 64 or 128) refused."""
    assert accepted({"tiers.small.quant_group_size": size}).tiers["small"].quant_group_size == size


@pytest.mark.parametrize("size", [16, 256])
def test_other_group_sizes_are_refused(size: int) -> None:
    """Bug it catches: the group-size check dropped or widened."""
    assert refused({"tiers.small.quant_group_size": size}) == [
        ("tiers.small.quant_group_size", f"must be 32, 64 or 128, got {size}")
    ]


def test_kv_cache_memory_is_parsed_at_load() -> None:
    """Bug it catches: the kv_cache_memory check skipped, or its error not put on the field (an
    unparseable size only fails when the tier starts)."""
    assert accepted({"tiers.small.kv_cache_memory": "512MiB"}).tiers["small"].kv_cache_memory == "512MiB"
    assert accepted({"tiers.small.kv_cache_memory": "0.25"}).tiers["small"].kv_cache_memory == "0.25"
    found = refused({"tiers.small.kv_cache_memory": "lots"})
    assert len(found) == 1 and found[0][0] == "tiers.small.kv_cache_memory" and "'lots'" in found[0][1]


def test_activation_quantization_needs_int4() -> None:
    """Bug it catches: ``==`` for ``!=`` / ``or`` for ``and`` in the W4A8 check: int8 activations
    accepted on int8 or unquantized weights, or refused on int4."""
    ok = accepted({"tiers.small.quantization": "int4", "tiers.small.activation_quantization": "int8"})
    assert ok.tiers["small"].activation_quantization == "int8"
    assert accepted({"tiers.small.quantization": "int8"}).tiers["small"].activation_quantization == "none"
    for weights in ("int8", "none"):
        found = refused({"tiers.small.quantization": weights, "tiers.small.activation_quantization": "int8"})
        assert found == [
            ("tiers.small.activation_quantization", f"'int8' needs quantization: int4, got {weights}")
        ]


def test_head_int8_tokens_needs_an_int4_quantized_head() -> None:
    """Bug it catches: ``or`` for ``and`` in the head check (int4 alone, or quantize_head alone,
    accepted), or the check applied when head_int8_tokens is 0 (the default refused)."""
    ok = accepted(
        {
            "tiers.small.quantization": "int4",
            "tiers.small.quantize_head": True,
            "tiers.small.head_int8_tokens": 64,
        }
    )
    assert ok.tiers["small"].head_int8_tokens == 64
    assert accepted({"tiers.small.quantization": "int8", "tiers.small.quantize_head": True})
    message = "needs quantization: int4 and quantize_head: true"
    for quant, head in (("int4", False), ("int8", True), ("none", False)):
        found = refused(
            {
                "tiers.small.quantization": quant,
                "tiers.small.quantize_head": head,
                "tiers.small.head_int8_tokens": 64,
            }
        )
        assert found == [("tiers.small.head_int8_tokens", message)], (quant, head, found)


@pytest.mark.parametrize("tokens", [100, 32, -64])
def test_head_int8_tokens_is_a_non_negative_multiple_of_64(tokens: int) -> None:
    """Bug it catches: the ``< 0`` half dropped (-64 is a multiple of 64), ``% 32`` for ``% 64``,
    or ``and`` for ``or`` between the halves."""
    found = refused(
        {
            "tiers.small.quantization": "int4",
            "tiers.small.quantize_head": True,
            "tiers.small.head_int8_tokens": tokens,
        }
    )
    assert found == [("tiers.small.head_int8_tokens", f"must be a multiple of 64 >= 0, got {tokens}")]


def test_speculative_tokens_at_most_16() -> None:
    """Bug it catches: ``>=`` for ``>`` (16 refused) or a changed cap."""
    assert accepted({"tiers.medium.speculative_tokens": 16}).tiers["medium"].speculative_tokens == 16
    assert refused({"tiers.medium.speculative_tokens": 17}) == [
        ("tiers.medium.speculative_tokens", "must be <= 16, got 17")
    ]


@pytest.mark.parametrize("field", ["timeout_s", "max_queue_wait_s", "circuit_cooldown_s"])
def test_tier_durations_must_be_positive(field: str) -> None:
    """Bug it catches: ``<`` for ``<=`` (a zero timeout loads) or a duration dropped from the list."""
    assert getattr(accepted({f"tiers.small.{field}": 0.001}).tiers["small"], field) == 0.001
    for bad in (0, -1.0):
        assert refused({f"tiers.small.{field}": bad}) == [(f"tiers.small.{field}", "must be > 0")]


@pytest.mark.parametrize(
    ("field", "good", "bad", "message"),
    [
        ("max_tokens", [1], [0], "must be >= 1"),
        ("temperature", [0.0, 2.0], [-0.01, 2.01], "must be in [0, 2]"),
        ("top_p", [0.01, 1.0], [0.0, 1.01], "must be in (0, 1]"),
    ],
)
def test_generation_defaults_ranges(field: str, good: list[float], bad: list[float], message: str) -> None:
    """Bug it catches: a closed end made open or the reverse (``temperature: 0`` - greedy -
    refused, ``top_p: 0`` accepted), or a changed bound."""
    for v in good:
        assert getattr(accepted({f"tiers.small.defaults.{field}": v}).tiers["small"].defaults, field) == v
    for v in bad:
        assert refused({f"tiers.small.defaults.{field}": v}) == [(f"tiers.small.defaults.{field}", message)]


# -- drafts --------------------------------------------------------------------------------------
def test_draft_errors_name_the_draft_field() -> None:
    """Bug it catches: a missing draft tier accepted (or its message listing no tiers), a tier
    drafting for itself accepted, a remote draft target accepted (its KV is in another process)."""
    assert refused({"tiers.medium.draft": "tiny"}) == [
        ("tiers.medium.draft", "names tier 'tiny', which does not exist; tiers: small, medium, large")
    ]
    assert set(refused({"tiers.medium.draft": "medium"})) == {
        ("tiers.medium.draft", "a tier cannot draft for itself"),
        ("tiers.medium.draft", "draft cycle: medium -> medium"),
        ("tiers.large.draft", "draft cycle: large -> medium -> medium"),
    }
    assert refused({"tiers.small.model": REMOTE}) == [
        (
            "tiers.medium.draft",
            "tier 'small' is remote and cannot be a draft (its KV is not in this process)",
        )
    ]


def test_a_remote_tier_cannot_use_a_draft() -> None:
    """Bug it catches: the remote-tier check only on one branch (``draft: ngram`` or a tier draft
    on a remote tier accepted), or applied to local tiers."""
    assert refused({"tiers.large.model": REMOTE}) == [
        ("tiers.large.draft", "a remote tier cannot use a draft")
    ]
    assert refused(
        {"tiers.small.model": REMOTE, "tiers.small.draft": "ngram", "tiers.medium.draft": None}
    ) == [("tiers.small.draft", "a remote tier cannot use a draft")]
    assert accepted({"tiers.large.model": REMOTE, "tiers.large.draft": None}).tiers["large"].is_remote
    assert accepted({"tiers.small.draft": "ngram"}).tiers["small"].draft == "ngram"


def test_a_draft_cycle_is_named_with_its_path() -> None:
    """Bug it catches: the cycle walk stopping early (no error), ``continue`` for ``break`` or a
    missing ``break`` (the walk never ends: the test times out), or the path printed wrong."""
    found = refused({"tiers.small.draft": "large"})
    assert ("tiers.small.draft", "draft cycle: small -> large -> medium -> small") in found
    assert ("tiers.medium.draft", "draft cycle: medium -> small -> large -> medium") in found
    assert ("tiers.large.draft", "draft cycle: large -> medium -> small -> large") in found
    assert len(found) == 3


def test_a_draft_chain_into_a_missing_tier_is_not_a_crash() -> None:
    """Bug it catches: the cycle walk following a draft that names no tier (KeyError instead of the
    one "does not exist" error)."""
    assert refused({"tiers.small.draft": "tiny"}) == [
        ("tiers.small.draft", "names tier 'tiny', which does not exist; tiers: small, medium, large")
    ]


# -- names ---------------------------------------------------------------------------------------
NAME_MESSAGE = (
    " must be 1-128 printable ASCII characters without leading or trailing spaces "
    "(it is sent in x-router-* response headers)"
)


@pytest.mark.parametrize("name", ["a", "x" * 128, "my tier", "a!~b", "~"])
def test_header_safe_tier_names_are_accepted(name: str) -> None:
    """Bug it catches: the name pattern narrowed (one character, 128 characters, an inner space or
    punctuation refused)."""
    text = build().replace("large", f"'{name}'")
    assert name in parse_policy(text).tiers


@pytest.mark.parametrize("name", ["x" * 129, " lead", "trail ", "caf\u00e9", "tab\tname", ""])
def test_unsafe_tier_names_are_refused(name: str) -> None:
    """Bug it catches: the pattern widened (129 characters, a leading/trailing space, non-ASCII or
    a control character accepted, or the empty name): these go into x-router-tier headers."""
    text = build().replace("large", yaml.safe_dump(name).split("\n")[0])
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    found = [(i.path, i.message) for i in info.value.issues]
    assert (f"tiers.{name}", f"tier name {name[:40]!r}{NAME_MESSAGE}") in found, found


def test_the_name_in_the_message_is_cut_at_40_characters() -> None:
    """Bug it catches: the cut moved (``name[:41]``) or the full 300-character name echoed."""
    name = "y" * 300 + " "
    found = refused({"tiers.small.draft": None, "routing.rules.0.name": name})
    assert ("routing.rules[0].name", f"rule name '{'y' * 40}'{NAME_MESSAGE}") in found, found


def test_rule_tenant_and_alias_names_are_checked() -> None:
    """Bug it catches: the name check missing for rules, tenants or aliases, or the wrong word
    (``what``) or path in its message."""
    found = refused(
        {"routing.rules.2.name": "bad\u00e9", "routing.aliases": {"fast ": "small"}},
        tenants={" t": {}},
    )
    assert ("routing.rules[2].name", f"rule name 'bad\u00e9'{NAME_MESSAGE}") in found, found
    assert ("routing.aliases.fast ", f"alias 'fast '{NAME_MESSAGE}") in found, found
    assert ("tenants. t", f"tenant name ' t'{NAME_MESSAGE}") in found, found
    assert len(found) == 3


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("auto", "'auto' is reserved for routed requests"),
        ("ngram", "'ngram' is reserved: `draft: ngram` drafts by n-gram lookup"),
    ],
)
def test_reserved_tier_names(name: str, message: str) -> None:
    """Bug it catches: ``auto`` or ``ngram`` allowed as a tier name (a value that means two things)."""
    text = build({"tiers.medium.draft": None}).replace("small", name)
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    assert [(i.path, i.message) for i in info.value.issues] == [(f"tiers.{name}", message)]


def test_version_and_empty_tiers() -> None:
    """Bug it catches: an unsupported version accepted, or a policy with no tiers accepted."""
    assert refused(version=2) == [("version", "unsupported version 2; supported: [1]")]
    assert accepted(version=1).version == 1
    found = refused(tiers={})
    assert ("tiers", "at least one tier is required") in found


# -- aliases, fallbacks, load_aware, escalation --------------------------------------------------
def test_aliases() -> None:
    """Bug it catches: an alias to a missing tier accepted, an alias shadowing a tier or ``auto``
    accepted, or ``and`` for ``or`` between the two shadow cases; a valid alias refused."""
    assert (
        accepted({"routing.aliases": {"fast": "small", "best": "large"}}).routing.aliases["fast"] == "small"
    )
    assert refused({"routing.aliases": {"fast": "tiny"}}) == [
        ("routing.aliases.fast", "names tier 'tiny', which does not exist")
    ]
    shadow = "an alias cannot shadow a tier name or 'auto'"
    assert refused({"routing.aliases": {"medium": "large"}}) == [("routing.aliases.medium", shadow)]
    assert refused({"routing.aliases": {"auto": "large"}}) == [("routing.aliases.auto", shadow)]


def test_fallbacks() -> None:
    """Bug it catches: a fallback from or to a missing tier accepted, or a null fallback (429)
    refused."""
    ok = accepted({"routing.fallback": {"small": "medium", "medium": "large", "large": None}})
    assert ok.routing.fallback == {"small": "medium", "medium": "large", "large": None}
    assert refused({"routing.fallback": {"tiny": "large"}}) == [
        ("routing.fallback.tiny", "'tiny' is not a tier")
    ]
    assert refused({"routing.fallback": {"small": "huge"}}) == [
        ("routing.fallback.small", "names tier 'huge', which does not exist")
    ]


def test_load_aware_settings() -> None:
    """Bug it catches: a rule list naming a missing rule accepted (or flagged at the wrong index),
    ``<=`` for ``<`` on up_tolerance / min_device_rows (0, documented as "applies load
    everywhere", refused)."""
    ok = accepted({"routing.load_aware": {"rules": ["s", "m"], "up_tolerance": 0.0, "min_device_rows": 0}})
    assert (ok.routing.load_aware.up_tolerance, ok.routing.load_aware.min_device_rows) == (0.0, 0)
    assert refused({"routing.load_aware": {"rules": ["s", "x"]}}) == [
        ("routing.load_aware.rules[1]", "names rule 'x', which does not exist")
    ]
    assert refused({"routing.load_aware": {"up_tolerance": -0.01}}) == [
        ("routing.load_aware.up_tolerance", "must be >= 0, got -0.01")
    ]
    assert refused({"routing.load_aware": {"min_device_rows": -1}}) == [
        ("routing.load_aware.min_device_rows", "must be >= 0, got -1")
    ]


def test_escalation_confidence_is_in_0_1() -> None:
    """Bug it catches: the open/closed ends swapped (1 refused, 0 accepted) or null refused."""
    for v in (0.01, 1.0, None):
        assert (
            accepted({"routing.escalation": {"confidence_below": v}}).routing.escalation.confidence_below == v
        )
    for v in (0.0, 1.01):
        assert refused({"routing.escalation": {"confidence_below": v}}) == [
            ("routing.escalation.confidence_below", "must be in (0, 1]")
        ]


def test_sessions_bounds() -> None:
    """Bug it catches: ``max_entries: 1`` refused or 0 accepted; ``ttl_s`` 0 accepted."""
    assert accepted({"routing.sessions": {"max_entries": 1, "ttl_s": 0.5}}).routing.sessions.max_entries == 1
    assert refused({"routing.sessions": {"max_entries": 0}}) == [
        ("routing.sessions.max_entries", "must be >= 1")
    ]
    assert refused({"routing.sessions": {"ttl_s": 0}}) == [("routing.sessions.ttl_s", "must be > 0")]


# -- shadow --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["sample", "max_busy_fraction"])
def test_shadow_fractions_are_in_0_1(field: str) -> None:
    """Bug it catches: an open end where [0, 1] is closed (0 or 1 refused) or a bound dropped."""
    for v in (0.0, 1.0):
        assert getattr(accepted(shadow={field: v}).shadow, field) == v
    for v in (-0.01, 1.01):
        assert refused(shadow={field: v}) == [(f"shadow.{field}", f"must be in [0, 1], got {v}")]


@pytest.mark.parametrize("field", ["max_concurrent", "max_tokens"])
def test_shadow_counts_are_at_least_one(field: str) -> None:
    """Bug it catches: ``<=`` for ``<`` (1 refused) or a field dropped from the loop."""
    assert getattr(accepted(shadow={field: 1}).shadow, field) == 1
    assert refused(shadow={field: 0}) == [(f"shadow.{field}", "must be >= 1, got 0")]


def test_shadow_tier_and_rules_must_exist() -> None:
    """Bug it catches: a shadow tier or rule that does not exist accepted, or valid ones refused."""
    ok = accepted(shadow={"tier": "large", "rules": ["s", "default"]})
    assert (ok.shadow.tier, ok.shadow.rules) == ("large", ["s", "default"])
    assert refused(shadow={"tier": "huge"}) == [
        ("shadow.tier", "names tier 'huge', which does not exist; tiers: small, medium, large")
    ]
    assert refused(shadow={"rules": ["s", "nope"]}) == [
        ("shadow.rules[1]", "names rule 'nope', which does not exist")
    ]


# -- tenants -------------------------------------------------------------------------------------
def test_tenant_settings() -> None:
    """Bug it catches: an unknown allowed tier accepted (or at the wrong index), ``[]`` accepted
    (a tenant that can use nothing), ``null`` (all tiers) refused, or a rate limit of 1 refused /
    0 accepted."""
    ok = accepted(
        tenants={"a": {"allowed_tiers": ["small"], "rate_limit_rpm": 1, "rate_limit_tpm": 1}, "b": {}}
    )
    assert ok.tenants["a"].rate_limit_rpm == 1 and ok.tenants["b"].allowed_tiers is None
    assert refused(tenants={"a": {"allowed_tiers": ["small", "huge"]}}) == [
        ("tenants.a.allowed_tiers[1]", "'huge' is not a tier")
    ]
    assert refused(tenants={"a": {"allowed_tiers": []}}) == [
        ("tenants.a.allowed_tiers", "must name at least one tier")
    ]
    for field in ("rate_limit_rpm", "rate_limit_tpm"):
        assert refused(tenants={"a": {field: 0}}) == [(f"tenants.a.{field}", "must be >= 1")]


# -- service -------------------------------------------------------------------------------------
def test_open_auth_refuses_key_sources() -> None:
    """Bug it catches: ``== "keys"`` for ``== "open"`` or a key source dropped from the loop: keys
    configured next to ``mode: open`` silently ignored (the operator believes auth is on)."""
    message = "is ignored with mode 'open' (no auth); use mode 'keys' or remove it"
    found = refused(service={"auth": {"mode": "open", "api_keys_env": "K", "api_keys_file": "/k"}})
    assert found == [("service.auth.api_keys_env", message), ("service.auth.api_keys_file", message)]
    ok = accepted(service={"auth": {"mode": "keys", "api_keys_env": "K", "api_keys_file": "/k"}})
    assert ok.service.auth.api_keys_file == "/k"
    assert accepted(service={"auth": {"mode": "open"}}).service.auth.mode == "open"


@pytest.mark.parametrize(
    ("section", "field", "good", "bad", "message"),
    [
        ("auth", "rate_limit_rpm", 1, 0, "must be >= 1"),
        ("auth", "rate_limit_tpm", 1, 0, "must be >= 1"),
        ("cache", "redis_timeout_s", 0.001, 0, "must be > 0"),
        ("cache", "max_entries", 1, 0, "must be >= 1"),
        ("cache", "ttl_s", 0.001, 0, "must be > 0"),
        ("feedback", "max_ids", 1, 0, "must be >= 1"),
        ("feedback", "ttl_s", 0.001, 0, "must be > 0"),
        ("limits", "grammar_timeout_s", 0.001, 0, "must be > 0"),
    ],
)
def test_service_section_bounds(section: str, field: str, good: float, bad: float, message: str) -> None:
    """Bug it catches: ``<=`` for ``<`` or the reverse at a service bound (the smallest valid value
    refused, or 0 accepted), or the message put on another path."""
    assert getattr(getattr(accepted(service={section: {field: good}}).service, section), field) == good
    assert refused(service={section: {field: bad}}) == [(f"service.{section}.{field}", message)]


@pytest.mark.parametrize(
    ("field", "good", "bad", "message"),
    [
        ("max_request_timeout_s", 0.001, 0, "must be > 0"),
        ("queue_timeout_s", 0.001, 0, "must be > 0"),
        ("drain_timeout_s", 0.001, 0, "must be > 0"),
        ("max_body_bytes", 1024, 1023, "must be >= 1024"),
        ("fair_slowdown", 1.0, 0.99, "must be >= 1 (or null: no holding back)"),
    ],
)
def test_service_bounds(field: str, good: float, bad: float, message: str) -> None:
    """Bug it catches: an off-by-one or flipped service bound (``max_body_bytes: 1024`` refused,
    ``fair_slowdown: 1.0`` - no slowdown allowed - refused, a zero timeout accepted)."""
    assert getattr(accepted(service={field: good}).service, field) == good
    assert refused(service={field: bad}) == [(f"service.{field}", message)]


def test_fair_slowdown_null_is_valid() -> None:
    """Bug it catches: ``is None`` for ``is not None`` (null crashes the comparison or is refused)."""
    assert accepted(service={"fair_slowdown": None}).service.fair_slowdown is None


def test_semantic_threshold_is_in_0_1() -> None:
    """Bug it catches: the (0, 1] ends swapped (1 refused, 0 accepted)."""
    for v in (0.01, 1.0):
        assert (
            accepted(service={"cache": {"semantic": {"threshold": v}}}).service.cache.semantic.threshold == v
        )
    for v in (0.0, 1.01):
        assert refused(service={"cache": {"semantic": {"threshold": v}}}) == [
            ("service.cache.semantic.threshold", "must be in (0, 1]")
        ]


@pytest.mark.parametrize(
    ("field", "minimum"),
    [
        ("max_logit_bias", 0),
        ("max_prompts", 1),
        ("max_tools", 1),
        ("max_schema_nodes", 1),
        ("max_schema_depth", 1),
        ("max_schema_properties", 1),
        ("max_schema_chars", 1),
        ("max_request_tokens", 1),
    ],
)
def test_request_limits_minimums(field: str, minimum: int) -> None:
    """Bug it catches: a limit's minimum off by one (``max_logit_bias: 0`` - refuse logit_bias -
    refused, ``max_tools: 0`` - refuse every tool call - accepted) or a limit dropped from the loop."""
    assert getattr(accepted(service={"limits": {field: minimum}}).service.limits, field) == minimum
    assert refused(service={"limits": {field: minimum - 1}}) == [
        (f"service.limits.{field}", f"must be >= {minimum}, got {minimum - 1}")
    ]


# -- rules ---------------------------------------------------------------------------------------
def test_at_least_one_rule() -> None:
    """Bug it catches: an empty rule list accepted (every request would fail to route)."""
    assert refused({"routing.rules": []}) == [
        ("routing.rules", "at least one rule is required (the last one without 'when')")
    ]


def test_rule_name_and_tier_errors() -> None:
    """Bug it catches: a duplicate name accepted or naming the wrong earlier index, a rule to a
    missing tier accepted (or its message listing no tiers)."""
    assert refused({"routing.rules.1.name": "s"}) == [
        ("routing.rules[1].name", "duplicate rule name 's' (also rules[0])")
    ]
    assert refused({"routing.rules.1.tier": "huge"}) == [
        ("routing.rules[1].tier", "names tier 'huge', which does not exist; tiers: small, medium, large")
    ]


def test_a_rule_after_the_default_is_unreachable() -> None:
    """Bug it catches: the "after a rule without when" check dropped or naming the wrong rule, or
    the last-rule check skipped."""
    found = refused(
        rules(
            {"name": "a", "tier": "large"},
            {"name": "b", "when": {"tenant": ["t"]}, "tier": "small"},
        )
    )
    assert found == [
        ("routing.rules[1]", "unreachable: rules[0] ('a') has no 'when' and matches everything"),
        ("routing.rules[1]", "the last rule must have no 'when' (the default rule)"),
    ]


def test_rules_are_checked_in_priority_order() -> None:
    """Bug it catches: the checks walking file order rather than evaluation order: a default rule
    first in the file with the lowest priority is valid (it is evaluated last), and errors name
    file indices."""
    ok = accepted(
        rules(
            {"name": "default", "tier": "large", "priority": -1},
            {"name": "s", "when": {"score_below": 0.3}, "tier": "small"},
            {"name": "agents", "when": {"has_tools": True}, "tier": "large", "priority": 10},
        )
    )
    assert [r.name for _, r in ok.routing.ordered_rules] == ["agents", "s", "default"]
    found = refused(
        rules(
            {"name": "default", "tier": "large"},
            {"name": "late", "when": {"tenant": ["t"]}, "tier": "small", "priority": -1},
        )
    )
    assert found == [
        ("routing.rules[1]", "unreachable: rules[0] ('default') has no 'when' and matches everything"),
        ("routing.rules[1]", "the last rule must have no 'when' (the default rule)"),
    ]


@pytest.mark.parametrize("second", [0.3, 0.2])
def test_score_thresholds_out_of_order(second: float) -> None:
    """Bug it catches: ``<`` for ``<=`` (an equal threshold, which never matches, accepted), the
    rule also reported as unreachable (``continue`` dropped), or the message naming the wrong
    earlier rule."""
    found = refused({"routing.rules.1.when.score_below": second})
    assert found == [
        (
            "routing.rules[1].when.score_below",
            f"thresholds out of order: {second} must be greater than rules[0].when.score_below (0.3), "
            "or this rule never matches",
        )
    ]


def test_the_rules_after_an_out_of_order_threshold_are_still_checked() -> None:
    """Bug it catches: ``break`` for ``continue`` after the out-of-order error (later rules go
    unchecked) or the highest threshold not kept (a third rule compared to the wrong one)."""
    found = refused(
        rules(
            {"name": "a", "when": {"score_below": 0.5}, "tier": "small"},
            {"name": "b", "when": {"score_below": 0.4}, "tier": "medium"},
            {"name": "c", "when": {"score_below": 0.45}, "tier": "huge"},
            {"name": "default", "tier": "large"},
        )
    )
    assert [p for p, _ in found] == [
        "routing.rules[1].when.score_below",
        "routing.rules[2].when.score_below",
        "routing.rules[2].tier",
    ], found
    assert "0.45 must be greater than rules[0].when.score_below (0.5)" in found[1][1]


def test_only_score_only_rules_set_the_threshold_floor() -> None:
    """Bug it catches: the ``is_score_only`` / ``score_at_least is None`` guards dropped: a
    ``score_below`` next to a tenant or a ``score_at_least`` is not a floor for later rules, so
    a lower plain threshold after it is valid."""
    for first in ({"score_below": 0.6, "tenant": ["t"]}, {"score_below": 0.6, "score_at_least": 0.1}):
        ok = accepted(
            rules(
                {"name": "a", "when": first, "tier": "medium"},
                {"name": "b", "when": {"score_below": 0.3}, "tier": "small"},
                {"name": "default", "tier": "large"},
            )
        )
        assert len(ok.routing.rules) == 3


def test_rules_with_the_same_conditions() -> None:
    """Bug it catches: identical conditions not reported, reported against every earlier copy
    (``break`` dropped), or as the subset message."""
    found = refused(
        rules(
            {"name": "a", "when": {"headers": {"x-a": "b"}}, "tier": "small"},
            {"name": "b", "when": {"headers": {"x-a": "b"}}, "tier": "medium"},
            {"name": "c", "when": {"headers": {"x-a": "b"}}, "tier": "medium"},
            {"name": "default", "tier": "large"},
        )
    )
    assert found == [
        ("routing.rules[1]", "unreachable: rules[0] ('a') has the same conditions and comes first"),
        ("routing.rules[2]", "unreachable: rules[0] ('a') has the same conditions and comes first"),
    ]


def test_a_rule_implied_by_an_earlier_one_is_unreachable() -> None:
    """Bug it catches: the subsumption check dropped, run in the wrong direction (the broader later
    rule refused), or reported more than once."""
    sub = "comes first and matches every request this rule matches (its conditions are a subset of these)"
    found = refused(
        rules(
            {"name": "ab", "when": {"tenant": ["a", "b"]}, "tier": "medium"},
            {"name": "a", "when": {"tenant": ["a"], "score_below": 0.5}, "tier": "small"},
            {"name": "default", "tier": "large"},
        )
    )
    assert found == [("routing.rules[1]", f"unreachable: rules[0] ('ab') {sub}")]
    ok = accepted(
        rules(
            {"name": "a", "when": {"tenant": ["a"], "score_below": 0.5}, "tier": "small"},
            {"name": "ab", "when": {"tenant": ["a", "b"]}, "tier": "medium"},
            {"name": "default", "tier": "large"},
        )
    )
    assert len(ok.routing.rules) == 3


def test_the_last_rule_must_be_the_default() -> None:
    """Bug it catches: a policy whose last rule has a ``when`` accepted (some requests match no
    rule), or the error put on another rule."""
    found = refused({"routing.rules": BASE["routing"]["rules"][:2]})
    assert found == [("routing.rules[1]", "the last rule must have no 'when' (the default rule)")]


# -- conditions ----------------------------------------------------------------------------------
def when(cond: dict[str, Any]) -> dict[str, Any]:
    return rules({"name": "r", "when": cond, "tier": "small"}, {"name": "default", "tier": "large"})


def refused_when(cond: dict[str, Any]) -> list[tuple[str, str]]:
    return refused(when(cond))


@pytest.mark.parametrize("field", ["score_below", "score_at_least", "confidence_below"])
def test_score_fields_are_in_0_1(field: str) -> None:
    """Bug it catches: an open end where [0, 1] is closed (``score_below: 0`` or ``score_at_least:
    1`` refused), a bound dropped, or a field missing from the loop."""
    for v in (0.0, 1.0):
        cond = accepted(when({field: v})).routing.rules[0].when
        assert cond is not None and getattr(cond, field) == v
    for v in (-0.01, 1.01):
        assert refused_when({field: v}) == [(f"routing.rules[0].when.{field}", f"must be in [0, 1], got {v}")]


def test_a_score_range_must_not_be_empty() -> None:
    """Bug it catches: ``>`` for ``>=`` (``score_at_least == score_below``, an empty range,
    accepted) or a non-empty range refused."""
    assert accepted(when({"score_at_least": 0.3, "score_below": 0.6}))
    for low in (0.6, 0.7):
        assert refused_when({"score_at_least": low, "score_below": 0.6}) == [
            ("routing.rules[0].when.score_at_least", "must be below score_below, or the rule never matches")
        ]


def test_a_prompt_length_range_must_not_be_empty() -> None:
    """Bug it catches: ``>`` for ``>=`` on the prompt-token range, or the check on one field only."""
    assert accepted(when({"prompt_tokens_above": 10, "prompt_tokens_at_most": 11}))
    assert accepted(when({"prompt_tokens_above": 10}))
    for above in (11, 12):
        assert refused_when({"prompt_tokens_above": above, "prompt_tokens_at_most": 11}) == [
            (
                "routing.rules[0].when.prompt_tokens_above",
                "must be below prompt_tokens_at_most, or the rule never matches",
            )
        ]


def test_a_turn_range_may_be_one_value() -> None:
    """Bug it catches: ``>=`` for ``>`` on turns (``turns_at_least: 3, turns_at_most: 3`` - exactly
    three turns - refused) or an empty range accepted."""
    assert accepted(when({"turns_at_least": 3, "turns_at_most": 3}))
    assert refused_when({"turns_at_least": 4, "turns_at_most": 3}) == [
        ("routing.rules[0].when.turns_at_least", "must be at most turns_at_most, or the rule never matches")
    ]


@pytest.mark.parametrize(
    "field", ["turns_at_least", "turns_at_most", "prompt_tokens_above", "prompt_tokens_at_most"]
)
def test_counts_are_non_negative(field: str) -> None:
    """Bug it catches: ``<=`` for ``<`` (0 refused) or a field dropped from the loop."""
    assert accepted(when({field: 0}))
    assert refused_when({field: -1}) == [(f"routing.rules[0].when.{field}", "must be >= 0, got -1")]


def test_predicted_classes() -> None:
    """Bug it catches: a class name dropped from (small, medium, large) or another accepted; the
    error at the wrong list index."""
    assert accepted(when({"predicted": ["small", "medium", "large"]}))
    assert refused_when({"predicted": ["small", "huge"]}) == [
        ("routing.rules[0].when.predicted[1]", "must be small, medium or large, got 'huge'")
    ]


@pytest.mark.parametrize("field", ["keywords", "language", "response_format", "any_of", "all_of"])
def test_empty_lists_never_match(field: str) -> None:
    """Bug it catches: a field dropped from the empty-list check, or ``is None`` confused with
    ``== []`` (a rule that can never fire loads silently)."""
    assert refused_when({field: [], "tenant": ["t"]}) == [
        (
            f"routing.rules[0].when.{field}",
            "is an empty list and never matches; remove it or name at least one",
        )
    ]


def test_keywords_must_not_be_blank() -> None:
    """Bug it catches: a blank keyword (``"  "``) accepted, or the error at the wrong index."""
    assert accepted(when({"keywords": ["stack trace", "x"]}))
    assert refused_when({"keywords": ["ok", "  "]}) == [
        ("routing.rules[0].when.keywords[1]", "must not be blank")
    ]


@pytest.mark.parametrize("code", ["en", "zh", "und"])
def test_language_codes_accepted(code: str) -> None:
    """Bug it catches: the ISO 639-1 pattern narrowed (``und`` - unsure - refused)."""
    assert accepted(when({"language": [code]}))


@pytest.mark.parametrize("code", ["EN", "eng", "e", "en-US", "undx"])
def test_language_codes_refused(code: str) -> None:
    """Bug it catches: ``match``/``search`` for ``fullmatch`` or a widened pattern (``eng``,
    ``en-US`` or upper case accepted: the heuristic never yields them, the rule never fires)."""
    assert refused_when({"language": ["en", code]}) == [
        (
            "routing.rules[0].when.language[1]",
            f"must be an ISO 639-1 code such as 'en' or 'zh' (or 'und'), got '{code}'",
        )
    ]


def test_nested_conditions_are_checked_with_their_paths() -> None:
    """Bug it catches: any_of / all_of / not not recursed into, or the nested path built wrong."""
    found = refused_when(
        {
            "any_of": [{"tenant": ["a"]}, {"score_below": 1.5}],
            "all_of": [{"language": ["EN"]}],
            "not": {"turns_at_most": -1},
        }
    )
    assert found == [
        ("routing.rules[0].when.any_of[1].score_below", "must be in [0, 1], got 1.5"),
        (
            "routing.rules[0].when.all_of[0].language[0]",
            "must be an ISO 639-1 code such as 'en' or 'zh' (or 'und'), got 'EN'",
        ),
        ("routing.rules[0].when.not.turns_at_most", "must be >= 0, got -1"),
    ]


def test_an_empty_when_is_refused() -> None:
    """Bug it catches: ``any`` for ``all`` in the empty check (every real condition refused) or an
    empty ``when: {}`` - which matches everything - accepted where a default rule is meant."""
    assert refused_when({}) == [("routing.rules[0].when", "is empty; remove 'when' for a default rule")]
    assert refused_when({"any_of": [{}]}) == [
        ("routing.rules[0].when.any_of[0]", "is empty; remove 'when' for a default rule")
    ]
    assert accepted(when({"has_tools": False})).routing.rules[0].when == Condition(has_tools=False)


# -- subsumes ------------------------------------------------------------------------------------
C = Condition


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (C(), C(tenant=["x"]), True),
        (C(score_below=0.5), C(score_below=0.3), True),
        (C(score_below=0.5), C(score_below=0.5), True),
        (C(score_below=0.5), C(score_below=0.6), False),
        (C(score_below=0.5), C(), False),
        (C(score_at_least=0.5), C(score_at_least=0.7), True),
        (C(score_at_least=0.5), C(score_at_least=0.5), True),
        (C(score_at_least=0.5), C(score_at_least=0.4), False),
        (C(score_at_least=0.5), C(), False),
        (C(confidence_below=0.5), C(confidence_below=0.4), True),
        (C(confidence_below=0.5), C(confidence_below=0.6), False),
        (C(confidence_below=0.5), C(), False),
        (C(prompt_tokens_above=10), C(prompt_tokens_above=20), True),
        (C(prompt_tokens_above=10), C(prompt_tokens_above=10), True),
        (C(prompt_tokens_above=10), C(prompt_tokens_above=5), False),
        (C(prompt_tokens_above=10), C(), False),
        (C(prompt_tokens_at_most=10), C(prompt_tokens_at_most=5), True),
        (C(prompt_tokens_at_most=10), C(prompt_tokens_at_most=10), True),
        (C(prompt_tokens_at_most=10), C(prompt_tokens_at_most=20), False),
        (C(prompt_tokens_at_most=10), C(), False),
        (C(turns_at_least=2), C(turns_at_least=3), True),
        (C(turns_at_least=2), C(turns_at_least=2), True),
        (C(turns_at_least=2), C(turns_at_least=1), False),
        (C(turns_at_least=2), C(), False),
        (C(turns_at_most=2), C(turns_at_most=1), True),
        (C(turns_at_most=2), C(turns_at_most=2), True),
        (C(turns_at_most=2), C(turns_at_most=3), False),
        (C(turns_at_most=2), C(), False),
        (C(has_tools=True), C(has_tools=True), True),
        (C(has_tools=False), C(has_tools=False), True),
        (C(has_tools=True), C(has_tools=False), False),
        (C(has_tools=False), C(), False),
        (C(logprobs=True), C(logprobs=True), True),
        (C(logprobs=True), C(logprobs=False), False),
        (C(logprobs=True), C(), False),
        (C(predicted=["small", "medium"]), C(predicted=["small"]), True),
        (C(predicted=["small"]), C(predicted=["small", "large"]), False),
        (C(predicted=["small"]), C(), False),
        (C(model=["a", "b"]), C(model=["b"]), True),
        (C(model=["a"]), C(model=["b"]), False),
        (C(model=["a"]), C(), False),
        (C(tenant=["a", "b"]), C(tenant=["a"]), True),
        (C(tenant=["a"]), C(tenant=["a", "b"]), False),
        (C(response_format=["json_object", "json_schema"]), C(response_format=["json_schema"]), True),
        (C(response_format=["json_object"]), C(response_format=["json_schema"]), False),
        (C(language=["en", "de"]), C(language=["de"]), True),
        (C(language=["en"]), C(language=["de"]), False),
        (C(language=["en"]), C(), False),
        (C(keywords=["Stack Trace", "segfault"]), C(keywords=["stack trace"]), True),
        (C(keywords=["segfault"]), C(keywords=["SEGFAULT", "panic"]), False),
        (C(keywords=["segfault"]), C(), False),
        (C(headers={"X-Priority": ["high", "urgent"]}), C(headers={"x-priority": "high"}), True),
        (C(headers={"x-priority": "high"}), C(headers={"X-PRIORITY": ["high"], "x-b": "1"}), True),
        (C(headers={"x-priority": "high"}), C(headers={"x-priority": ["high", "urgent"]}), False),
        (C(headers={"x-priority": "high"}), C(headers={"x-priority": "low"}), False),
        (C(headers={"x-priority": "high"}), C(headers={"x-other": "high"}), False),
        (C(headers={"x-priority": "high"}), C(), False),
        (C(headers={"x-a": "1", "x-b": "2"}), C(headers={"x-a": "1"}), False),
        (C(any_of=[C(tenant=["a"])]), C(any_of=[C(tenant=["a"])]), True),
        (C(any_of=[C(tenant=["a"])]), C(any_of=[C(tenant=["b"])]), False),
        (C(any_of=[C(tenant=["a"])]), C(), False),
        (C(all_of=[C(tenant=["a"])]), C(all_of=[C(tenant=["a"])], model=["m"]), True),
        (C(all_of=[C(tenant=["a"])]), C(all_of=[C(tenant=["b"])]), False),
        (C(not_=C(tenant=["a"])), C(not_=C(tenant=["a"]), score_below=0.2), True),
        (C(not_=C(tenant=["a"])), C(not_=C(tenant=["b"])), False),
        (C(tenant=["a"], score_below=0.5), C(tenant=["a"], score_below=0.3, has_tools=True), True),
        (C(tenant=["a"], score_below=0.5), C(tenant=["a"], score_below=0.7), False),
    ],
)
def test_subsumes(a: Condition, b: Condition, expected: bool) -> None:
    """Bug it catches: a flipped comparison on one field (``>=`` for ``<=``: a narrower threshold
    read as broader), a field missing from the checks (any value implied), ``or`` for ``and``
    (an unset field in ``b`` read as implied), case-sensitive keywords or header names, or header
    values compared in the wrong direction. Reference: ``a`` subsumes ``b`` when every request
    matching ``b`` matches ``a``, worked by hand per field."""
    assert subsumes(a, b) is expected
