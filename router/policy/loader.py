"""Load a policy YAML into the typed schema, reporting *every* error with its field path and line.

Two passes: a structural one that walks the dataclass types (``router.policy.convert``: unknown
keys, wrong types, missing fields) and a semantic one across fields (``router.policy.checks``: a
draft naming a missing tier, draft cycles, thresholds out of order, unreachable rules...). Nothing
is half-applied: either a whole ``Policy`` comes back or ``PolicyError`` lists what to fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from router.errors import PolicyError, PolicyIssue
from router.policy.checks import check_policy
from router.policy.convert import MISSING, FieldPath, Issues, convert_dataclass, describe, node_lines
from router.policy.schema import Policy

__all__ = ["load_policy", "parse_policy"]


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """Parse and validate policy YAML text; raise ``PolicyError`` listing every issue."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise PolicyError(
            source, [PolicyIssue("(syntax)", str(getattr(exc, "problem", exc)), line)]
        ) from None
    lines: dict[FieldPath, int] = {}
    if node is not None:
        node_lines(node, (), lines)
    ctx = Issues(lines)
    if not isinstance(data, dict):
        ctx.error((), f"a policy is a mapping with 'tiers' and 'routing', got {describe(data)}")
        raise PolicyError(source, ctx.issues)
    policy = convert_dataclass(data, Policy, (), ctx)
    if policy is not MISSING:
        check_policy(policy, ctx)
    if ctx.issues:
        raise PolicyError(source, sorted(ctx.issues, key=lambda i: i.line or 0))
    assert isinstance(policy, Policy)
    policy.source = source
    policy.digest = hashlib.sha256(text.encode()).hexdigest()
    return policy


def load_policy(path: str | Path) -> Policy:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(str(p), [PolicyIssue("(file)", f"cannot read policy file: {exc}", None)]) from None
    return parse_policy(text, str(p))


def policy_to_dict(obj: Any) -> Any:
    """The policy as plain data (for ``/v1/route`` debugging and the dashboard)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: policy_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: policy_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [policy_to_dict(v) for v in obj]
    return obj
