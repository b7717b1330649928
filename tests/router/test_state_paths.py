"""Where the feedback and shadow logs go when the policy does not say: the state directory, never
the working directory (a test run left ``feedback.jsonl`` in the checkout; a deployment's working
directory may be read-only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.policy.loader import parse_policy

POLICY = "tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"


def test_defaults_are_in_the_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    policy = parse_policy(POLICY)
    assert policy.service.feedback.log_path == str(tmp_path / "state" / "feedback.jsonl")
    assert policy.shadow.log_path == str(tmp_path / "state" / "shadow.jsonl")


def test_without_a_state_dir_xdg_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERED_ROUTER_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert parse_policy(POLICY).service.feedback.log_path == str(
        tmp_path / "xdg" / "tiered-router" / "feedback.jsonl"
    )
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parse_policy(POLICY).shadow.log_path == str(
        tmp_path / "home" / ".local" / "state" / "tiered-router" / "shadow.jsonl"
    )


def test_a_path_in_the_policy_is_kept(tmp_path: Path) -> None:
    text = (
        POLICY
        + f"service: {{feedback: {{log_path: {tmp_path / 'f.jsonl'}}}}}\nshadow: {{log_path: s.jsonl}}\n"
    )
    policy = parse_policy(text)
    assert policy.service.feedback.log_path == str(tmp_path / "f.jsonl")
    assert policy.shadow.log_path == "s.jsonl"


def test_the_feedback_log_writes_where_its_default_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end through the writer: nothing lands in the working directory."""
    from router.pipeline.shadow import _JsonlWriter

    monkeypatch.setenv("TIERED_ROUTER_STATE_DIR", str(tmp_path / "state"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _JsonlWriter(parse_policy(POLICY).service.feedback.log_path).write({"id": "x"})
    assert (tmp_path / "state" / "feedback.jsonl").read_text() == '{"id": "x"}\n'
    assert list(cwd.iterdir()) == []
