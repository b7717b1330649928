"""``service.classifier.device``: which onnxruntime provider the routing score runs on.

Catches the policy's choice being dropped on the way to ``ComplexityClassifier.load`` (a GPU node
would open onnxruntime's CUDA provider beside the tiers, or never use it when asked) and a typo
passing validation silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.cli import main
from router.errors import PolicyError
from router.policy.loader import parse_policy

BASE = "tiers: {small: {model: m}}\nrouting: {rules: [{name: d, tier: small}]}\n"


def test_default_is_the_cpu_provider_and_a_typo_names_the_field() -> None:
    assert parse_policy(BASE).service.classifier.device == "cpu"
    assert parse_policy(BASE + "service: {classifier: {device: auto}}\n").service.classifier.device == "auto"
    with pytest.raises(PolicyError) as info:
        parse_policy(BASE + "service: {classifier: {device: gpu}}\n")
    assert "service.classifier.device" in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_policy_device_reaches_the_loader(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from classifier import ComplexityClassifier

    asked: list[Any] = []
    real = ComplexityClassifier.load.__func__  # type: ignore[attr-defined]

    def recording(cls: type, path: Any = None, providers: Any = None, device: str = "cpu") -> Any:
        asked.append(device)
        return real(cls, path, ["CPUExecutionProvider"])

    monkeypatch.setattr(ComplexityClassifier, "load", classmethod(recording))
    policy = tmp_path / "policy.yaml"
    policy.write_text(BASE + f"service: {{classifier: {{device: {device}}}}}\n")
    assert main(["route", "--policy", str(policy), "hello there"]) == 0
    assert asked == [device]
    assert '"tier": "small"' in capsys.readouterr().out
