"""Writing calibrated ``score_below`` thresholds into a policy file, in place.

``tiered-router classifier calibrate --write-policy FILE`` proposes thresholds with
:mod:`classifier.calibrate` (which knows scores, not policies) and hands them here: the policy's
side edits its own YAML and validates the result with its own loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from classifier.validation.calibrate import DECIMALS

__all__ = ["write_thresholds"]


def write_thresholds(policy_path: str | Path, thresholds: Mapping[str, float]) -> dict[str, float]:
    """Put the thresholds into a policy file's score rules, in place; returns ``{rule: new value}``.

    A *score rule* is a ``routing.rules`` entry routing to ``small`` or ``medium`` whose ``when``
    holds only ``score_below``. Only those numbers change: the edit replaces the scalar's exact
    characters (located with the YAML parser), so comments, order and layout stay as they were.
    The result is validated with the policy loader before the file is replaced.
    """
    import yaml

    from router.policy.loader import load_policy

    path = Path(policy_path)
    text = path.read_text(encoding="utf-8")
    root = yaml.compose(text)
    edits: list[tuple[int, int, str, str]] = []

    def get(node: Any, key: str) -> Any:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == key:
                    return v
        return None

    rules = get(get(root, "routing"), "rules")
    for rule in rules.value if isinstance(rules, yaml.SequenceNode) else []:
        tier, when, name = get(rule, "tier"), get(rule, "when"), get(rule, "name")
        if tier is None or tier.value not in thresholds or not isinstance(when, yaml.MappingNode):
            continue
        if [k.value for k, _ in when.value] != ["score_below"]:
            continue
        scalar = get(when, "score_below")
        new = repr(round(float(thresholds[tier.value]), DECIMALS))
        edits.append(
            (scalar.start_mark.index, scalar.end_mark.index, new, name.value if name else tier.value)
        )
    if not edits:
        raise ValueError(f"{path}: no score rules (tier small/medium, when: {{score_below: ...}}) to update")
    for start, end, new, _ in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    tmp = path.with_name(path.name + ".calibrate.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_policy(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return {name: float(new) for _, _, new, name in edits}
