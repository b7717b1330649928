"""``tiered-router classifier …`` subcommands (classifier/cli.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from classifier.cli import main, register
from classifier.data import HELDOUT_PATH, TRAIN_PATH, load_jsonl, write_jsonl
from router.policy.thresholds import write_thresholds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-router")
    register(parser.add_subparsers(dest="command", required=True), policy_writer=write_thresholds)
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_register_adds_the_three_commands() -> None:
    parser = _parser()
    for argv in (
        ["classifier", "train", "--data", "d.jsonl", "--out", "o"],
        ["classifier", "evaluate", "--data", "d.jsonl", "--json"],
        ["classifier", "calibrate", "--data", "d.jsonl", "--shares", "small=1"],
    ):
        assert callable(parser.parse_args(argv).func)
    with pytest.raises(SystemExit):
        parser.parse_args(["classifier"])


def test_evaluate_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["classifier", "evaluate", "--data", str(HELDOUT_PATH), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert set(metrics) == {"n", "accuracy", "macro_f1", "confusion", "severe_error_rate", "p50_ms", "p99_ms"}


def test_evaluate_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["classifier", "evaluate", "--data", str(HELDOUT_PATH)]) == 0
    assert "confusion" in capsys.readouterr().out


def test_calibrate_prints_thresholds_and_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "classifier",
        "calibrate",
        "--data",
        str(HELDOUT_PATH),
        "--shares",
        "small=0.5,medium=0.3,large=0.2",
    ]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    snippet = out[out.index("routing:") :]
    rules = yaml.safe_load(snippet)["routing"]["rules"]
    assert [r["tier"] for r in rules] == ["small", "medium", "large"]
    assert _run([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["thresholds"]["small"] == rules[0]["when"]["score_below"]


def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.jsonl")
    assert _run(["classifier", "evaluate", "--data", missing]) == 2
    assert _run(["classifier", "calibrate", "--data", str(HELDOUT_PATH), "--shares", "tiny=1"]) == 2
    assert _run(["classifier", "train", "--data", missing, "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_train_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    write_jsonl(data, load_jsonl(TRAIN_PATH)[::10])
    write_jsonl(heldout, load_jsonl(HELDOUT_PATH)[::10])
    out = tmp_path / "model"
    # heldout.jsonl next to --data is picked up by default
    assert main(["train", "--data", str(data), "--out", str(out), "--seed", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["heldout"]["n"] == len(load_jsonl(heldout))
    assert (out / "model.onnx").is_file()
    assert json.loads((out / "metadata.json").read_text())["seed"] == 3


def test_serving_imports_stay_light() -> None:
    code = (
        "import sys, argparse\n"
        "from classifier import ComplexityClassifier\n"
        "import classifier.cli, classifier.validation.evaluate, classifier.validation.calibrate\n"
        "p = argparse.ArgumentParser(); classifier.cli.register(p.add_subparsers())\n"
        "ComplexityClassifier.load().score('hello')\n"
        "heavy = [m for m in ('sklearn', 'skl2onnx', 'scipy', 'onnx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def _outcome_file(tmp_path: Path) -> Path:
    """Corpus prompts with outcomes: the weak model fails on every prompt labeled large."""
    rows = [
        {"prompt": r["prompt"], "weak": int(r["label"] != "large"), "strong": 1, "subject": f"s{i % 4}"}
        for i, r in enumerate(load_jsonl(HELDOUT_PATH))
    ]
    path = tmp_path / "outcomes.jsonl"
    write_jsonl(path, rows)
    return path


def test_train_and_evaluate_on_outcomes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, out = _outcome_file(tmp_path), tmp_path / "model"
    assert _run(["classifier", "train", "--outcomes", str(data), "--out", str(out), "--no-proxy"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["heldout_subjects"] == ["s3"]  # one whole subject of four kept out
    png = tmp_path / "curve.png"
    argv = ["classifier", "evaluate", "--outcomes", str(data), "--model", str(out), "--png", str(png)]
    assert _run([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("apgr", "cpt_50", "cpt_80", "curve", "baselines", "p50_ms", "p99_ms", "png"):
        assert key in result, key
    assert result["n"] == trained["n"] and result["apgr"] == pytest.approx(trained["apgr"], abs=1e-4)
    assert result["apgr"] > result["baselines"]["random"]["apgr"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert _run(argv) == 0
    assert "CPT(80%)" in capsys.readouterr().out


def test_train_needs_data_or_outcomes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["classifier", "train", "--out", "x"]) == 2
    assert "--outcomes" in capsys.readouterr().err


def test_calibrate_writes_the_thresholds_into_a_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    original = (Path(__file__).resolve().parents[2] / "policies/default.yaml").read_text()
    policy.write_text(original)
    argv = [
        "classifier",
        "calibrate",
        "--data",
        str(HELDOUT_PATH),
        "--shares",
        "small=0.6,medium=0.3,large=0.1",
    ]
    assert _run([*argv, "--write-policy", str(policy), "--json"]) == 0
    rules = {r["name"]: r for r in yaml.safe_load(policy.read_text())["routing"]["rules"]}
    result = json.loads(_capture(argv))
    assert rules["score-small"]["when"]["score_below"] == result["thresholds"]["small"]
    assert rules["score-medium"]["when"]["score_below"] == result["thresholds"]["medium"]
    # Only the two numbers changed: comments and every other line are as they were.
    changed = [
        (a, b) for a, b in zip(original.splitlines(), policy.read_text().splitlines(), strict=True) if a != b
    ]
    assert len(changed) == 2 and all("score_below" in a for a, _ in changed)


def _capture(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert _run([*argv, "--json"]) == 0
    return buf.getvalue()


def test_calibrate_refuses_a_policy_without_score_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("tiers:\n  small: {model: m}\nrouting:\n  rules:\n    - {name: all, tier: small}\n")
    before = policy.read_text()
    argv = ["classifier", "calibrate", "--data", str(HELDOUT_PATH), "--shares", "small=1"]
    assert _run([*argv, "--write-policy", str(policy)]) == 2
    assert "no score rules" in capsys.readouterr().err
    assert policy.read_text() == before
