"""router/policy/service_schema.py: the ``service:`` section's defaults, its enumerated options and
its state directory.

The reference is README's policy reference (every default it lists under ``service:``, e.g.
``max_body_bytes: 1048576``, ``limits: max_logit_bias: 300 ... grammar_timeout_s: 5.0``) and
``state_file``'s documented lookup order (``$TIERED_ROUTER_STATE_DIR``, else
``$XDG_STATE_HOME/tiered-router``, else ``~/.local/state/tiered-router``), worked by hand.
Policies are parsed from YAML strings with ``parse_policy``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from router.errors import PolicyError
from router.policy.loader import parse_policy
from router.policy.schema import ServiceConfig
from router.policy.service_schema import FeedbackConfig, LimitsConfig, state_file

MINIMAL = """
tiers:
  small: {model: 'embedded:smollm2-135m-instruct'}
routing:
  rules:
    - {name: default, tier: small}
"""


def service(section: str = "") -> ServiceConfig:
    return parse_policy(MINIMAL + (f"service:\n{section}" if section else "")).service


def issues(section: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(MINIMAL + f"service:\n{section}")
    return [(i.path, i.message) for i in info.value.issues]


def test_service_defaults() -> None:
    """Bug it catches: a changed top-level service default (``max_body_bytes`` 1 MiB, queue and drain
    30 s, ``max_request_timeout_s`` 600, ``fair_slowdown`` 1.25)."""
    s = service()
    assert (s.max_body_bytes, s.queue_timeout_s, s.max_request_timeout_s) == (1_048_576, 30.0, 600.0)
    assert (s.drain_timeout_s, s.fair_slowdown) == (30.0, 1.25)


def test_auth_defaults() -> None:
    """Bug it catches: auth open by default (``mode: open``), the tenant header trusted by default
    (any caller picks its tenant), or a default rate limit."""
    a = service().auth
    assert (a.mode, a.api_keys_env, a.api_keys_file, a.trust_tenant_header) == ("keys", None, None, False)
    assert (a.rate_limit_rpm, a.rate_limit_tpm) == (None, None)


def test_cache_defaults() -> None:
    """Bug it catches: a changed cache default (ttl 600 s, 10,000 entries, memory backend,
    ``REDIS_URL``, 0.25 s Redis timeout, sampled answers not cached, semantic cache off at 0.92)."""
    c = service().cache
    assert (c.enabled, c.ttl_s, c.max_entries, c.backend) == (True, 600.0, 10_000, "memory")
    assert (c.redis_url_env, c.redis_timeout_s, c.cache_sampled) == ("REDIS_URL", 0.25, False)
    assert (c.semantic.enabled, c.semantic.threshold) == (False, 0.92)


def test_classifier_telemetry_and_feedback_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Bug it catches: a changed default (2000 context characters, the cpu provider, content
    recorded on spans by default, feedback off, 100,000 ids, a 1-day ttl) or the feedback log
    written elsewhere than ``feedback.jsonl`` in the state directory."""
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path))
    s = service()
    assert (s.classifier.path, s.classifier.context_chars, s.classifier.device) == (None, 2000, "cpu")
    assert s.telemetry.record_content is False
    f = s.feedback
    assert (f.enabled, f.max_ids, f.ttl_s) == (True, 100_000, 86_400.0)
    assert f.log_path == str(tmp_path / "feedback.jsonl")


LIMIT_DEFAULTS = {
    "max_logit_bias": 300,
    "max_tools": 128,
    "max_schema_nodes": 2000,
    "max_schema_depth": 24,
    "max_schema_properties": 300,
    "max_schema_chars": 65_536,
    "max_request_tokens": 65_536,
    "max_prompts": 32,
    "grammar_timeout_s": 5.0,
}


def test_limits_defaults() -> None:
    """Bug it catches: a request limit's default off by one or changed (``max_tools = 127`` refuses
    OpenAI's 128 tools; ``max_logit_bias = 301`` lets past OpenAI's cap), in the dataclass or as
    loaded."""
    loaded = service().limits
    built = LimitsConfig()
    for name, value in LIMIT_DEFAULTS.items():
        assert getattr(loaded, name) == value, name
        assert getattr(built, name) == value, name


@pytest.mark.parametrize(("name", "value"), list(LIMIT_DEFAULTS.items()))
def test_each_limit_is_settable_at_and_past_its_default(name: str, value: float) -> None:
    """Bug it catches: a limit field renamed (README's key unknown) or its value not taken from the
    YAML; each loads exactly as written, one above the default too."""
    for v in (value, value + 1):
        assert getattr(service(f"  limits: {{{name}: {v}}}\n").limits, name) == v


def test_falsy_service_values_are_kept() -> None:
    """Bug it catches: a false, 0 or null read as unset (``fair_slowdown: null`` - share slots only -
    replaced by 1.25; ``max_logit_bias: 0`` - refuse logit_bias - by 300; the cache or feedback
    switched back on)."""
    s = service(
        "  fair_slowdown: null\n"
        "  cache: {enabled: false, semantic: {enabled: false}}\n"
        "  feedback: {enabled: false}\n"
        "  classifier: {context_chars: 0}\n"
        "  limits: {max_logit_bias: 0}\n"
        "  auth: {trust_tenant_header: false}\n"
    )
    assert s.fair_slowdown is None
    assert (s.cache.enabled, s.feedback.enabled, s.classifier.context_chars) == (False, False, 0)
    assert s.limits.max_logit_bias == 0
    assert s.auth.trust_tenant_header is False


def test_set_values_replace_the_defaults() -> None:
    """Bug it catches: a field's value ignored for the default (the README example's settings)."""
    s = service(
        "  auth: {mode: open, trust_tenant_header: true, rate_limit_rpm: 60, rate_limit_tpm: 1000}\n"
        "  cache: {backend: redis, redis_url_env: MY_REDIS, cache_sampled: true, "
        "semantic: {enabled: true, threshold: 0.8}}\n"
        "  classifier: {path: /models/clf, device: auto}\n"
        "  telemetry: {record_content: true}\n"
        "  feedback: {log_path: fb.jsonl}\n"
    )
    assert (s.auth.mode, s.auth.trust_tenant_header, s.auth.rate_limit_rpm, s.auth.rate_limit_tpm) == (
        "open",
        True,
        60,
        1000,
    )
    assert (s.cache.backend, s.cache.redis_url_env, s.cache.cache_sampled) == ("redis", "MY_REDIS", True)
    assert (s.cache.semantic.enabled, s.cache.semantic.threshold) == (True, 0.8)
    assert (s.classifier.path, s.classifier.device) == ("/models/clf", "auto")
    assert s.telemetry.record_content is True and s.feedback.log_path == "fb.jsonl"


@pytest.mark.parametrize(
    ("section", "key", "options"),
    [
        ("auth", "mode", ["keys", "open"]),
        ("cache", "backend", ["memory", "redis"]),
        ("classifier", "device", ["cpu", "auto", "cuda"]),
    ],
)
def test_each_documented_option_is_accepted(section: str, key: str, options: list[str]) -> None:
    """Bug it catches: an option dropped from its Literal (``backend: redis`` or ``device: cuda``,
    both documented, refused)."""
    for option in options:
        assert getattr(getattr(service(f"  {section}: {{{key}: {option}}}\n"), section), key) == option


@pytest.mark.parametrize(
    ("section", "key", "bad", "listed"),
    [
        ("auth", "mode", "none", "'keys' | 'open'"),
        ("cache", "backend", "memcached", "'memory' | 'redis'"),
        ("classifier", "device", "gpu", "'cpu' | 'auto' | 'cuda'"),
    ],
)
def test_other_options_are_refused(section: str, key: str, bad: str, listed: str) -> None:
    """Bug it catches: a Literal widened (``auth.mode: none`` - meant as "no auth"? - accepted) or
    listing other options than README."""
    assert issues(f"  {section}: {{{key}: {bad}}}\n") == [
        (f"service.{section}.{key}", f"must be one of {listed}, got str '{bad}'")
    ]


# -- state_file ----------------------------------------------------------------------------------
def test_state_file_prefers_the_router_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Bug it catches: ``$XDG_STATE_HOME`` read before ``$TIERED_ROUTER_STATE_DIR``, or the name
    not joined onto it."""
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path / "router"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_file("a.jsonl") == str(tmp_path / "router" / "a.jsonl")


@pytest.mark.parametrize("router_dir", [None, ""])
def test_state_file_falls_back_to_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, router_dir: str | None
) -> None:
    """Bug it catches: an empty ``$TIERED_ROUTER_STATE_DIR`` taken as the directory (logs in the
    working directory), or ``tiered-router`` not appended under ``$XDG_STATE_HOME``."""
    if router_dir is None:
        monkeypatch.delenv("TIERED_ROUTER_STATE_DIR", raising=False)
    else:
        monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", router_dir)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_file("a.jsonl") == str(tmp_path / "xdg" / "tiered-router" / "a.jsonl")


@pytest.mark.parametrize("xdg", [None, ""])
def test_state_file_falls_back_to_the_home_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None
) -> None:
    """Bug it catches: an empty ``$XDG_STATE_HOME`` taken as the directory, or the XDG default
    (``~/.local/state``) misspelt - never the working directory."""
    monkeypatch.delenv("TIERED_ROUTER_STATE_DIR", raising=False)
    if xdg is None:
        monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_STATE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert state_file("f.jsonl") == str(tmp_path / ".local" / "state" / "tiered-router" / "f.jsonl")


def test_the_feedback_log_default_is_read_when_the_config_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Bug it catches: the default log path computed once at import (a plain default instead of a
    ``default_factory``), so a state directory set later is ignored."""
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path / "one"))
    assert FeedbackConfig().log_path == str(tmp_path / "one" / "feedback.jsonl")
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path / "two"))
    assert FeedbackConfig().log_path == str(tmp_path / "two" / "feedback.jsonl")
