"""The ``tiered-router`` command: help, policy check, route, serve (startup errors and SIGTERM drain)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures import tiny_policy_yaml
from tests.router.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_help_lists_the_commands() -> None:
    out = cli("--help").stdout
    for command in ("serve", "route", "policy", "classifier", "models"):
        assert command in out
    assert "check" in cli("policy", "--help").stdout
    sub = cli("classifier", "--help").stdout
    assert "train" in sub and "evaluate" in sub


def test_policy_check_exit_codes(tmp_path: Path) -> None:
    ok = cli("policy", "check", str(ROOT / "policies/default.yaml"))
    assert ok.returncode == 0 and "valid" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\ntiers:\n  small: {model: m, draft: nope}\nrouting:\n  rules: [{name: d, tier: small}]\n"
    )
    res = cli("policy", "check", str(bad))
    assert res.returncode == 2
    assert f"{bad}:line 3: tiers.small.draft" in res.stderr
    missing = cli("policy", "check", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "missing.yaml" in missing.stderr


def test_route_prints_the_decision_as_json() -> None:
    res = cli("route", "Prove that the square root of 2 is irrational, step by step.")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert {"tier", "score", "rule", "probabilities"} <= set(out)
    assert out["tier"] in ("small", "medium", "large") and 0 <= out["score"] <= 1
    forced = json.loads(cli("route", "hi", "--model", "fast").stdout)
    assert forced["tier"] == "small" and forced["rule"] == "alias:fast"


def test_serve_with_a_broken_policy_exits_naming_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text(
        "version: 1\ntiers:\n  small: {model: m, max_num_seqs: lots}\n"
        "routing:\n  rules: [{name: d, tier: small}]\n"
    )
    res = cli("serve", "--policy", str(bad), "--port", str(free_port()), timeout=60)
    assert res.returncode != 0
    assert "broken.yaml" in res.stderr and "tiers.small.max_num_seqs" in res.stderr
    res = cli("serve", "--policy", str(tmp_path / "absent.yaml"), "--port", str(free_port()), timeout=60)
    assert res.returncode != 0 and "absent.yaml" in res.stderr


def test_sigterm_drains_in_flight_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(tiny_policy_yaml(tiny_model_dir, cache_enabled=False))
    port = free_port()
    env = dict(os.environ, TIERED_ROUTER_TORCH_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--policy", str(policy), "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("server never became ready")
        got: dict[str, object] = {}

        def stream() -> None:
            lines = []
            with httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                timeout=60,
                json={
                    "model": "large",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 230,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 2:
                            got["started"] = True
            got["lines"] = lines

        t = threading.Thread(target=stream)
        t.start()
        while "started" not in got and t.is_alive():
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        ready = httpx.get(url + "/readyz", timeout=5)
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        refused = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "small", "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 503 and "retry-after" in refused.headers
        t.join(60)
        lines = got["lines"]
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]"  # the in-flight stream finished
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "name",
    ['"evil\\r\\nset-cookie: x=1"', "café", '" padded"', '"tab\\tname"'],
)
def test_policy_check_rejects_names_that_are_not_header_safe(tmp_path: Path, name: str) -> None:
    bad = tmp_path / "names.yaml"
    bad.write_text(
        "version: 1\ntiers:\n  small: {model: m}\nrouting:\n"
        f"  rules:\n    - name: {name}\n      tier: small\nservice: {{auth: {{mode: open}}}}\n",
        encoding="utf-8",
    )
    res = cli("policy", "check", str(bad))
    assert res.returncode == 2, res.stdout
    assert "routing.rules[0].name" in res.stderr and "printable ASCII" in res.stderr


def test_policy_check_rejects_header_unsafe_tier_alias_and_tenant_names(tmp_path: Path) -> None:
    bad = tmp_path / "names.yaml"
    bad.write_text(
        'version: 1\ntiers:\n  "sm\\u00e4ll": {model: m}\nrouting:\n'
        '  aliases: {"f\\nast": "sm\\u00e4ll"}\n  rules: [{name: d, tier: "sm\\u00e4ll"}]\n'
        'tenants: {"a\\rb": {}}\n',
        encoding="utf-8",
    )
    res = cli("policy", "check", str(bad))
    assert res.returncode == 2
    for what in ("tier name", "alias", "tenant name"):
        assert what in res.stderr
