"""``tiered-router classifier …``: train, evaluate and calibrate from the command line.

:func:`register` adds the ``classifier`` command to the service CLI's subparsers; ``python -m
classifier.cli`` runs the same commands standalone. Only ``train`` imports scikit-learn/skl2onnx.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

PolicyWriter = Callable[[str, Mapping[str, float]], dict[str, float]]
"""Writes calibrated thresholds into a policy file (``router.policy.thresholds.write_thresholds``)."""

__all__ = [
    "cmd_calibrate",
    "cmd_evaluate",
    "cmd_judge",
    "cmd_train",
    "cmd_train_outcomes",
    "main",
    "register",
]


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _pair(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    weak, sep, strong = text.partition(",")
    if not sep or not weak.strip() or not strong.strip():
        raise ValueError(f"--pair {text!r}: expected WEAK_MODEL,STRONG_MODEL")
    return weak.strip(), strong.strip()


def cmd_train_outcomes(args: argparse.Namespace) -> int:
    from classifier.training.outcome_train import OUTCOME_CONFIG, PROXY_PATH, train_outcomes

    paths = [Path(args.outcomes), *(Path(p) for p in args.extra or [])]
    rated = [Path(p) for p in args.difficulty or []]
    for path in [*paths, *rated]:
        if not path.is_file():
            return _fail(f"no such file: {path}")
    extra = [] if args.no_proxy else [PROXY_PATH]
    config = OUTCOME_CONFIG
    if args.heldout_fraction is not None:
        config = dataclasses.replace(config, heldout_fraction=args.heldout_fraction)
    try:
        pair = _pair(args.pair)
        if pair is not None:
            config = dataclasses.replace(config, difficulty_pair=pair)
        metadata = train_outcomes(paths[0], args.out, config, extra, paths[1:], rated)
    except ValueError as exc:
        return _fail(str(exc))
    print(
        json.dumps({"out": str(args.out), "training_data": metadata["training_data"], **metadata["metrics"]})
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from classifier.training.train import CANDIDATES, train

    if args.outcomes is not None:
        return cmd_train_outcomes(args)
    if args.data is None:
        return _fail("give --data (labeled prompts) or --outcomes (weak/strong outcomes)")
    data = Path(args.data)
    if not data.is_file():
        return _fail(f"no such file: {data}")
    if args.heldout is not None:
        heldout: Path | None = Path(args.heldout)
    else:
        sibling = data.with_name("heldout.jsonl")
        heldout = sibling if sibling.is_file() and sibling.resolve() != data.resolve() else None
    metadata = train(data, args.out, seed=args.seed, config=CANDIDATES[args.config], heldout_path=heldout)
    print(
        json.dumps({"out": str(args.out), "training_data": metadata["training_data"], **metadata["metrics"]})
    )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from classifier.training.outcome_train import DIFFICULTY_PAIR, lofo_fitter
    from classifier.validation.evaluate import evaluate, evaluate_outcomes, format_families, format_report

    if args.outcomes is not None:
        files = list(args.outcomes)
        for path in files:
            if not Path(path).is_file():
                return _fail(f"no such file: {path}")
        results = {}
        try:
            pair = _pair(args.pair)
            for path in files:
                results[path] = evaluate_outcomes(
                    path,
                    args.model,
                    args.subjects,
                    args.png if len(files) == 1 else None,
                    pair=(pair or DIFFICULTY_PAIR) if _has_scores(path) else None,
                    compare=args.compare or [],
                    draws=args.bootstrap,
                    lofo=lofo_fitter() if args.lofo else None,
                )
        except (ValueError, FileNotFoundError) as exc:
            return _fail(str(exc))
        if args.json:
            print(json.dumps(results[files[0]] if len(files) == 1 else results))
            return 0
        for path, result in results.items():
            base = result["baselines"]
            print(f"{path}: n {result['n']}  subjects {result['subjects']}")
            print(
                f"APGR {result['apgr']:.4f}  CPT(50%) {result['cpt_50']:.4f}  CPT(80%) {result['cpt_80']:.4f}"
            )
            print(
                f"prompt length APGR {base['prompt_length']['apgr']:.4f}  random {base['random']['apgr']:.4f}"
            )
            print("per family (95 % bootstrap intervals):")
            print(format_families(result["families"]))
            print(f"mixed families (pooled): {result['mixed'].get('value')}")
            print(f"selection (worst of mixed, within): {result['selection'].get('value')}")
            if "lofo" in result:
                print("leave-one-family-out (recipe refitted without each family):")
                print(format_families(result["lofo"]["families"]))
                print(f"worst family: {result['lofo']['worst_family']}")
            print(f"latency p50 {result['p50_ms']:.3f} ms   p99 {result['p99_ms']:.3f} ms")
        return 0
    if args.data is None:
        return _fail("give --data (labeled prompts) or --outcomes (weak/strong outcomes)")
    if not Path(args.data).is_file():
        return _fail(f"no such file: {args.data}")
    try:
        metrics = evaluate(args.data, args.model)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    print(json.dumps(metrics) if args.json else format_report(metrics))
    return 0


def _has_scores(path: str) -> bool:
    """Whether an outcome file holds per-model pass rates (needs --pair) - its first line says."""
    import gzip

    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                return '"scores"' in line
    return False


def cmd_calibrate(args: argparse.Namespace) -> int:
    from classifier.validation.calibrate import calibrate, parse_shares

    if not Path(args.data).is_file():
        return _fail(f"no such file: {args.data}")
    try:
        result = calibrate(args.data, parse_shares(args.shares), args.model)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    if getattr(args, "write_policy", None) is not None:
        try:
            result["written"] = {
                "policy": args.write_policy,
                "rules": args.policy_writer(args.write_policy, result["thresholds"]),
            }
        except (ValueError, FileNotFoundError) as exc:
            return _fail(str(exc))
    if args.json:
        print(json.dumps(result))
        return 0
    targets, achieved = result["targets"], result["achieved"]
    print(f"n = {result['n']}")
    print(f"score_below  small {result['thresholds']['small']}   medium {result['thresholds']['medium']}")
    for tier in targets:
        print(f"  {tier:<7} target {targets[tier]:.3f}   achieved {achieved[tier]:.3f}")
    print()
    print(result["yaml"], end="")
    return 0


def cmd_judge(args: argparse.Namespace) -> int:
    from classifier.validation.judge import SCORERS, judge_shadow_log

    for path in (args.shadow, args.references):
        if not Path(path).is_file():
            return _fail(f"no such file: {path}")
    if args.scorer not in SCORERS:
        return _fail(f"unknown scorer {args.scorer!r} (one of {sorted(SCORERS)})")
    try:
        summary = judge_shadow_log(args.shadow, args.references, args.out, args.scorer)
    except (ValueError, json.JSONDecodeError) as exc:
        return _fail(str(exc))
    print(json.dumps({"out": str(args.out), "scorer": args.scorer, **summary}))
    return 0


def register(subparsers: Any, *, policy_writer: PolicyWriter | None = None) -> None:
    """Add ``classifier {train,evaluate,calibrate}`` to an argparse subparsers object; with a
    ``policy_writer``, ``calibrate --write-policy FILE`` too (the classifier edits no policy)."""
    parser = subparsers.add_parser(
        "classifier", help="train, evaluate and calibrate the complexity classifier"
    )
    _add_commands(parser.add_subparsers(dest="classifier_command", required=True), policy_writer)


def _add_commands(sub: Any, policy_writer: PolicyWriter | None = None) -> None:
    from classifier.training.train import (  # cheap: scikit-learn loads inside train()
        CANDIDATES,
        DEFAULT_CONFIG,
    )

    p = sub.add_parser(
        "train", help="train on labeled prompts or on outcomes; export model.onnx + metadata.json"
    )
    p.add_argument("--data", help='JSONL lines {"prompt": ..., "label": small|medium|large}')
    p.add_argument(
        "--outcomes",
        help='outcome JSONL(.gz): {"prompt", "weak", "strong"} or {"prompt", "outcomes": {tier: score}} '
        "(the routing score; the shipped artifact)",
    )
    p.add_argument(
        "--extra",
        nargs="*",
        help="--outcomes: more outcome files (judged shadow log, feedback log), merged by id",
    )
    p.add_argument(
        "--difficulty",
        nargs="*",
        help="--outcomes: pass-rate files (difficulty_7b.jsonl.gz), read under --pair",
    )
    p.add_argument(
        "--pair",
        help="WEAK_MODEL,STRONG_MODEL of pass-rate rows "
        "(default: mistralai/Mistral-7B-v0.1,cognitivecomputations/dolphin-2.9-llama3-8b)",
    )
    p.add_argument("--no-proxy", action="store_true", help="--outcomes: leave out the bundled proxy corpus")
    p.add_argument(
        "--heldout-fraction",
        type=float,
        help="--outcomes: share of subjects kept out for evaluation (default 0.25)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--heldout", help="labeled JSONL to report metrics on (default: heldout.jsonl next to --data)"
    )
    p.add_argument(
        "--config", choices=sorted(CANDIDATES), default=DEFAULT_CONFIG.name, help="model configuration"
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="accuracy on labeled prompts, or APGR/CPT on outcomes")
    p.add_argument("--data", help="labeled JSONL: accuracy, confusion, latency")
    p.add_argument(
        "--outcomes",
        nargs="+",
        help="outcome JSONL(.gz) file(s): APGR, CPT(50%%), CPT(80%%), curve, baselines, per family",
    )
    p.add_argument("--pair", help="--outcomes: WEAK_MODEL,STRONG_MODEL of pass-rate files (difficulty_7b)")
    p.add_argument(
        "--compare",
        action="append",
        help="--outcomes: another model directory scored side by side (repeatable)",
    )
    p.add_argument(
        "--lofo",
        action="store_true",
        help="--outcomes: refit the training recipe without each family and score it (needs ../shared data)",
    )
    p.add_argument("--bootstrap", type=int, default=200, help="--outcomes: bootstrap draws per interval")
    p.add_argument(
        "--subjects", choices=["heldout", "all"], default="heldout", help="--outcomes: rows to score"
    )
    p.add_argument("--png", help="--outcomes: write the PGR curve here")
    p.add_argument("--model", help="model directory or model.onnx (default: the shipped artifact)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "judge", help="score a shadow log's answers against references: outcome rows to train on"
    )
    p.add_argument("--shadow", required=True, help="shadow log (JSONL, as shadow mode writes it)")
    p.add_argument("--references", required=True, help='JSONL lines {"id" or "prompt", "reference"}')
    p.add_argument("--scorer", default="exact", help="exact | number | contains (default: exact)")
    p.add_argument("--out", required=True, help="judged outcome rows (JSONL) for train --extra")
    p.set_defaults(func=cmd_judge)

    p = sub.add_parser("calibrate", help="score_below thresholds that give target traffic shares")
    p.add_argument("--data", required=True, help='JSONL lines {"prompt": ...} (label optional)')
    p.add_argument("--shares", required=True, help="e.g. small=0.5,medium=0.3,large=0.2")
    if policy_writer is not None:
        p.add_argument(
            "--write-policy", help="policy YAML whose score rules get the thresholds (in place, validated)"
        )
    p.add_argument("--model", help="model directory or model.onnx (default: the shipped artifact)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_calibrate, policy_writer=policy_writer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m classifier.cli", description="the complexity classifier")
    _add_commands(parser.add_subparsers(dest="classifier_command", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
