"""router/policy/schema.py: the typed policy's defaults, its enumerated options, the YAML keys it
takes and its derived properties (``is_remote``, ``uses_score``, ``is_score_only``, rule order,
model names, the tier above).

The reference is the documented contract, worked by hand: README's policy reference (the
defaults it lists), DESIGN.md's policy keys (``draft: null`` turns drafting off) and the field
docstrings' own words (e.g. "descending priority; equal priorities keep their order in the file").
Policies are parsed from YAML strings with ``parse_policy``; properties are checked on hand-built
dataclasses.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from router.errors import PolicyError
from router.policy.loader import parse_policy
from router.policy.schema import Condition, Policy, Routing, Rule, TierConfig

MODEL = "embedded:smollm2-135m-instruct"

MINIMAL = f"""
tiers:
  small: {{model: '{MODEL}'}}
routing:
  rules:
    - {{name: default, tier: small}}
"""

THREE = f"""
tiers:
  small: {{model: '{MODEL}'}}
  medium: {{model: '{MODEL}'}}
  large: {{model: '{MODEL}'}}
routing:
  rules:
    - {{name: default, tier: large}}
"""


def parse(text: str) -> Policy:
    return parse_policy(textwrap.dedent(text), "p.yaml")


def issues(text: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse(text)
    return [(i.path, i.message) for i in info.value.issues]


def with_tier(fields: str) -> str:
    """MINIMAL with extra flow-mapping fields on the small tier."""
    return MINIMAL.replace(f"{{model: '{MODEL}'}}", f"{{model: '{MODEL}', {fields}}}")


# -- defaults (README's policy reference) --------------------------------------------------------
TIER_DEFAULTS: dict[str, Any] = {
    "dtype": "auto",
    "quantization": "none",
    "quant_group_size": 32,
    "quantize_head": False,
    "head_int8_tokens": 0,
    "activation_quantization": "none",
    "device": "auto",
    "max_num_seqs": 16,
    "max_queue": 64,
    "max_model_len": 2048,
    "max_num_batched_tokens": 512,
    "draft": None,
    "speculative_tokens": 4,
    "kv_cache_memory": None,
    "kv_cache_tokens": 16384,
    "block_size": 16,
    "prefix_caching": True,
    "batch_invariant": True,
    "cuda_graphs": False,
    "served_model_name": None,
    "api_key_env": None,
    "timeout_s": 120.0,
    "max_retries": 2,
    "max_queue_wait_s": 5.0,
    "circuit_failures": 5,
    "circuit_cooldown_s": 10.0,
}


def test_a_tier_with_only_a_model_gets_the_documented_defaults() -> None:
    """Bug it catches: a changed default in TierConfig or GenerationDefaults (e.g. ``max_queue =
    63``, ``block_size = 32``, ``prefix_caching = False``, ``max_tokens = 255``) - every policy that
    leaves the field out silently runs with another value than README documents."""
    tier = parse(MINIMAL).tiers["small"]
    assert tier.model == MODEL
    assert {name: getattr(tier, name) for name in TIER_DEFAULTS} == TIER_DEFAULTS
    d = tier.defaults
    assert (d.max_tokens, d.temperature, d.top_p) == (256, 1.0, 1.0)


def test_routing_tenant_shadow_and_version_defaults() -> None:
    """Bug it catches: a changed default of Routing, LoadAwareConfig, SessionConfig,
    EscalationConfig, Rule, TenantConfig or ShadowConfig (README: ``load_aware: {rules: null,
    up_tolerance: 0.05, join_running: true, min_device_rows: 4}``, ``sessions: {enabled: true,
    mode: floor, max_entries: 100000, ttl_s: 3600}``, shadow off with ``max_concurrent: 2`` ...)."""
    p = parse(MINIMAL + "tenants:\n  team: {}\n")
    assert p.version == 1
    r = p.routing
    assert r.mode == "static" and r.aliases == {} and r.fallback == {}
    la = r.load_aware
    assert (la.rules, la.up_tolerance, la.join_running, la.min_device_rows) == (None, 0.05, True, 4)
    s = r.sessions
    assert (s.enabled, s.mode, s.max_entries, s.ttl_s) == (True, "floor", 100_000, 3600.0)
    assert r.escalation.confidence_below is None
    rule = r.rules[0]
    assert (rule.name, rule.tier, rule.when, rule.priority) == ("default", "small", None, 0)
    t = p.tenants["team"]
    assert (t.allowed_tiers, t.rate_limit_rpm, t.rate_limit_tpm, t.priority) == (None, None, None, "normal")
    sh = p.shadow
    assert (sh.enabled, sh.sample, sh.tier, sh.rules, sh.tenants) == (False, 0.0, None, None, None)
    assert (sh.max_concurrent, sh.max_busy_fraction, sh.max_tokens) == (2, 0.5, 256)
    assert (sh.preempt, sh.record_content) == (True, None)


def test_shadow_log_defaults_to_the_state_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Bug it catches: ``state_file("shadow.json")`` or a bare ``"shadow.jsonl"`` (the working
    directory) as ShadowConfig.log_path's default - README: ``shadow.jsonl`` in the state dir."""
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path))
    assert parse(MINIMAL).shadow.log_path == f"{tmp_path}/shadow.jsonl"


def test_falsy_values_are_kept_not_replaced_by_defaults() -> None:
    """Bug it catches: a 0, 0.0, false or null read as "unset" so the (truthy) default stands in:
    ``max_queue: 0`` (reject at once), ``speculative_tokens: 0``, ``temperature: 0``, ``draft:
    null`` (DESIGN.md: drafting off), ``prefix_caching: false``, ``priority: 0`` after a
    negative one..."""
    text = with_tier(
        "max_queue: 0, speculative_tokens: 0, max_retries: 0, prefix_caching: false, "
        "batch_invariant: false, draft: null, defaults: {temperature: 0.0}"
    )
    text += textwrap.dedent(
        """
        shadow: {preempt: false, record_content: false, sample: 0.0}
        """
    )
    text = text.replace(
        "  rules:\n",
        "  load_aware: {join_running: false, min_device_rows: 0, up_tolerance: 0.0}\n"
        "  sessions: {enabled: false}\n"
        "  rules:\n",
    )
    p = parse(text)
    t = p.tiers["small"]
    assert (t.max_queue, t.speculative_tokens, t.max_retries) == (0, 0, 0)
    assert (t.prefix_caching, t.batch_invariant, t.draft) == (False, False, None)
    assert t.defaults.temperature == 0.0 and t.defaults.max_tokens == 256
    la = p.routing.load_aware
    assert (la.join_running, la.min_device_rows, la.up_tolerance) == (False, 0, 0.0)
    assert p.routing.sessions.enabled is False
    assert (p.shadow.preempt, p.shadow.record_content) == (False, False)


@pytest.mark.parametrize(
    ("fields", "attr", "options"),
    [
        ("dtype", "dtype", ["auto", "float32", "bfloat16", "float16"]),
        ("quantization", "quantization", ["none", "int8", "int4"]),
    ],
)
def test_each_documented_tier_option_is_accepted(fields: str, attr: str, options: list[str]) -> None:
    """Bug it catches: an option dropped from (or misspelt in) a Literal, so a documented value
    (``dtype: bfloat16``, ``quantization: int8``) is refused as "must be one of"."""
    for option in options:
        assert getattr(parse(with_tier(f"{fields}: {option}")).tiers["small"], attr) == option


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        (with_tier("dtype: fp8"), "tiers.small.dtype", "'auto' | 'float32' | 'bfloat16' | 'float16'"),
        (with_tier("quantization: int3"), "tiers.small.quantization", "'none' | 'int8' | 'int4'"),
        (
            with_tier("quantization: int4, activation_quantization: int4"),
            "tiers.small.activation_quantization",
            "'none' | 'int8'",
        ),
        (MINIMAL + "tenants:\n  t: {priority: urgent}\n", "tenants.t.priority", "'low' | 'normal' | 'high'"),
        (
            MINIMAL.replace("  rules:", "  mode: dynamic\n  rules:"),
            "routing.mode",
            "'static' | 'load_aware'",
        ),
        (
            MINIMAL.replace("  rules:", "  sessions: {mode: sticky}\n  rules:"),
            "routing.sessions.mode",
            "'floor' | 'pin'",
        ),
    ],
)
def test_an_undocumented_option_is_refused_naming_the_options(text: str, path: str, fragment: str) -> None:
    """Bug it catches: a Literal widened or reordered (``Literal["auto", "float32", "fp8"...]``):
    an unsupported value loads and fails later, or the error lists other options than README."""
    found = issues(text)
    assert len(found) == 1, found
    got_path, message = found[0]
    assert message.startswith("must be one of") and fragment in message, found
    if path:
        assert got_path == path


def test_other_enumerated_options_are_accepted() -> None:
    """Bug it catches: ``pin``, ``load_aware``, ``high``/``low``, ``activation_quantization:
    int8`` or a ``response_format`` type dropped from its Literal (a valid policy refused)."""
    p = parse(
        with_tier("quantization: int4, activation_quantization: int8").replace(
            "  rules:\n", "  mode: load_aware\n  sessions: {mode: pin}\n  rules:\n"
        )
        + "tenants:\n  a: {priority: low}\n  b: {priority: high}\n"
    )
    assert p.tiers["small"].activation_quantization == "int8"
    assert (p.routing.mode, p.routing.sessions.mode) == ("load_aware", "pin")
    assert [t.priority for t in p.tenants.values()] == ["low", "high"]
    rf = parse(
        MINIMAL.replace(
            "    - {name: default",
            "    - {name: fmt, when: {response_format: [text, json_object, json_schema]}, tier: small}\n"
            "    - {name: default",
        )
    )
    cond = rf.routing.rules[0].when
    assert cond is not None and cond.response_format == ["text", "json_object", "json_schema"]


def test_version_one_is_supported_and_nothing_else() -> None:
    """Bug it catches: SUPPORTED_VERSIONS changed (``(1, 2)``, ``(0,)``) or Policy.version's default
    changed: ``version: 1`` refused, or a future version loaded with today's meaning."""
    assert parse("version: 1\n" + MINIMAL).version == 1
    assert issues("version: 2\n" + MINIMAL) == [("version", "unsupported version 2; supported: [1]")]
    assert issues("version: 0\n" + MINIMAL)[0][0] == "version"


def test_ngram_draft_needs_no_tier_of_that_name() -> None:
    """Bug it catches: the NGRAM constant changed (``"n-gram"``): ``draft: ngram`` is then read as
    a tier name and refused as naming a missing tier."""
    assert parse(with_tier("draft: ngram")).tiers["small"].draft == "ngram"


def test_not_is_the_yaml_key_of_not_() -> None:
    """Bug it catches: the ``metadata={"key": "not"}`` of Condition.not_ dropped or misspelt: the
    README's ``not: {tenant: [vip]}`` is then an unknown key (and ``not_`` would be accepted)."""
    text = MINIMAL.replace(
        "    - {name: default",
        "    - {name: nv, when: {not: {tenant: [vip]}}, tier: small}\n    - {name: default",
    )
    cond = parse(text).routing.rules[0].when
    assert cond is not None and cond.not_ == Condition(tenant=["vip"])
    found = issues(text.replace("not:", "not_:"))
    assert any(p == "routing.rules[0].when.not_" and m.startswith("unknown key") for p, m in found), found


# -- derived properties --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "remote"),
    [
        ("http://vllm:8000/v1", True),
        ("https://api.example.com/v1", True),
        (MODEL, False),
        ("/models/https-mirror", False),
        ("models/http://x", False),
        ("httpserver/model.gguf", False),
    ],
)
def test_only_http_and_https_urls_are_remote(model: str, remote: bool) -> None:
    """Bug it catches: ``is_remote`` testing one scheme only, ``in`` instead of ``startswith``, or
    ``"http"`` without ``://`` (a local directory named ``httpserver`` sent to the network)."""
    assert TierConfig(model=model).is_remote is remote


@pytest.mark.parametrize(
    "cond",
    [
        Condition(score_below=0.0),
        Condition(score_at_least=0.5),
        Condition(predicted=["large"]),
        Condition(confidence_below=0.4),
        Condition(any_of=[Condition(tenant=["a"]), Condition(score_below=0.3)]),
        Condition(all_of=[Condition(score_at_least=0.1)]),
        Condition(not_=Condition(predicted=["small"])),
        Condition(any_of=[Condition(all_of=[Condition(not_=Condition(confidence_below=0.2))])]),
    ],
)
def test_conditions_on_the_score_use_it(cond: Condition) -> None:
    """Bug it catches: a score field left out of ``uses_score`` (load_aware's default rule set
    loses that rule), a truthiness test (``score_below: 0.0`` counted as unset), or a combinator
    (any_of / all_of / not) not searched."""
    assert cond.uses_score is True


@pytest.mark.parametrize(
    "cond",
    [
        Condition(),
        Condition(tenant=["a"], model=["m"], headers={"x-a": "b"}, has_tools=True, keywords=["k"]),
        Condition(prompt_tokens_above=10, turns_at_least=2, language=["en"], logprobs=False),
        Condition(
            any_of=[Condition(tenant=["a"])], all_of=[Condition(model=["m"])], not_=Condition(turns_at_most=3)
        ),
    ],
)
def test_conditions_off_the_score_do_not_use_it(cond: Condition) -> None:
    """Bug it catches: ``uses_score`` true for a header, tenant or length rule (``is None`` for
    ``is not None``, ``any`` for ``all`` over an empty tuple...): load would move a tier forced by
    a non-quality rule."""
    assert cond.uses_score is False


@pytest.mark.parametrize(
    ("cond", "expected"),
    [
        (Condition(score_below=0.3), True),
        (Condition(score_below=0.0), True),
        (Condition(score_at_least=0.7), True),
        (Condition(score_below=0.6, score_at_least=0.3), True),
        (Condition(), False),
        (Condition(score_below=0.3, tenant=["a"]), False),
        (Condition(score_at_least=0.3, predicted=["large"]), False),
        (Condition(score_below=0.3, not_=Condition(tenant=["a"])), False),
        (Condition(confidence_below=0.3), False),
    ],
)
def test_is_score_only(cond: Condition, expected: bool) -> None:
    """Bug it catches: ``and`` for ``or`` between the two score fields (a lone ``score_below``
    rule, the kind calibrate writes, not counted), a field missing from the exclusion (both
    thresholds set counted as "other fields"), or other fields ignored."""
    assert cond.is_score_only is expected


def test_rules_are_ordered_by_descending_priority_then_file_order() -> None:
    """Bug it catches: ascending priority (``key=ir[1].priority``), an unstable order among
    equal priorities, or file indices renumbered after sorting (errors name the wrong rule)."""
    rules = [
        Rule("a", "s"),
        Rule("b", "s", priority=10),
        Rule("c", "s"),
        Rule("d", "s", priority=10),
        Rule("e", "s", priority=-1),
        Rule("f", "s", priority=3),
    ]
    ordered = Routing(rules=rules).ordered_rules
    assert [(i, r.name) for i, r in ordered] == [(1, "b"), (3, "d"), (5, "f"), (0, "a"), (2, "c"), (4, "e")]


def test_model_names_list_auto_tiers_aliases_then_rule_models_sorted() -> None:
    """Bug it catches: ``auto`` missing from /v1/models, tiers or aliases left out, a rule model
    that is also a tier or alias listed twice, the extra names unsorted, or ``when: null`` rules
    crashing ``rule_models``."""
    text = THREE.replace(
        "  rules:\n",
        "  aliases: {fast: small}\n  rules:\n"
        "    - {name: r1, when: {model: [zeta, small, alpha]}, tier: medium}\n"
        "    - {name: r2, when: {model: [fast, mid, beta]}, tier: small}\n",
    )
    p = parse(text)
    assert p.tier_names == ["small", "medium", "large"]
    assert p.rule_models == frozenset({"zeta", "small", "alpha", "fast", "mid", "beta"})
    assert p.model_names == ["auto", "small", "medium", "large", "fast", "alpha", "beta", "mid", "zeta"]


def test_tier_above_steps_along_the_file_order() -> None:
    """Bug it catches: ``i + 1 <= len(names)`` (IndexError above the strongest tier), ``i - 1``
    (escalation moves down), or the strongest tier escalating to itself."""
    p = parse(THREE)
    assert [p.tier_above(t) for t in ("small", "medium", "large")] == ["medium", "large", None]
