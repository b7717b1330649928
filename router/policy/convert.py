"""YAML into typed dataclasses, generically: walk the dataclass types (unknown keys with a
did-you-mean, wrong types, missing fields) and record every problem with its field path and
line, so a loader reports all of them at once. Knows nothing of what a policy means
(``router.policy.checks`` does)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from router.errors import PolicyIssue

__all__ = ["MISSING", "FieldPath", "Issues", "convert_dataclass", "describe", "fmt_path", "node_lines"]

FieldPath = tuple[str | int, ...]


def fmt_path(path: FieldPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


class Issues:
    def __init__(self, lines: dict[FieldPath, int]) -> None:
        self.lines = lines
        self.issues: list[PolicyIssue] = []

    def error(self, path: FieldPath, message: str) -> None:
        line = None
        for i in range(len(path), -1, -1):  # nearest ancestor with a known line
            if path[:i] in self.lines:
                line = self.lines[path[:i]]
                break
        self.issues.append(PolicyIssue(fmt_path(path), message, line))


def node_lines(node: yaml.Node, path: FieldPath, out: dict[FieldPath, int]) -> None:
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = key.value
            out[(*path, k)] = key.start_mark.line + 1
            node_lines(value, (*path, k), out)
            out[(*path, k)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            node_lines(item, (*path, i), out)


# -- structural pass ----------------------------------------------------------------------------
MISSING = object()


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: FieldPath, ctx: Issues) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        real = [opt for opt in options if opt is not type(None)]
        if len(real) == 1:
            # ``X | None``: report X's own errors, with their nested paths (a trial conversion
            # would only say "expected X or null" about a mapping with one bad key deep inside).
            return _convert(value, real[0], path, ctx)
        for opt in options:  # the first option that converts without errors wins
            if opt is type(None):
                continue
            trial = Issues(ctx.lines)
            out = _convert(value, opt, path, trial)
            if not trial.issues:
                return out
        ctx.error(path, f"expected {_type_name(tp)}, got {describe(value)}")
        return MISSING
    if origin is Literal:
        if value in get_args(tp):
            return value
        ctx.error(path, f"must be one of {_type_name(tp)}, got {describe(value)}")
        return MISSING
    if origin is list:
        if not isinstance(value, list):
            ctx.error(path, f"expected a list, got {describe(value)}")
            return MISSING
        (item_tp,) = get_args(tp)
        items = [_convert(v, item_tp, (*path, i), ctx) for i, v in enumerate(value)]
        return [v for v in items if v is not MISSING]  # bad items are reported; keep checking the rest
    if origin is dict:
        if not isinstance(value, dict):
            ctx.error(path, f"expected a mapping, got {describe(value)}")
            return MISSING
        _, val_tp = get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                ctx.error((*path, str(k)), f"keys must be strings, got {describe(k)}")
                continue
            converted = _convert(v, val_tp, (*path, k), ctx)
            if converted is not MISSING:
                out[k] = converted
        return out
    if dataclasses.is_dataclass(tp):
        return convert_dataclass(value, tp, path, ctx)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            ctx.error(path, "must be a finite number")
            return MISSING
        return float(value)
    elif tp is str and isinstance(value, str):
        return value
    ctx.error(path, f"expected {_type_name(tp)}, got {describe(value)}")
    return MISSING


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) < 40 else text[:37] + '...'}"


def convert_dataclass(value: Any, cls: Any, path: FieldPath, ctx: Issues) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        ctx.error(path, f"expected a mapping, got {describe(value)}")
        return MISSING
    hints = get_type_hints(cls)  # resolved in the dataclass's own module
    # YAML key -> field: a field may name its key in metadata (``not`` is a Python keyword).
    fields = {
        f.metadata.get("key", f.name): f
        for f in dataclasses.fields(cls)
        if f.name not in ("source", "digest")
    }
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            ctx.error((*path, str(key)), f"unknown key{hint}; allowed: {', '.join(fields)}")
    kwargs = {}
    ok = True
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name in value:
            converted = _convert(value[name], hints[f.name], (*path, name), ctx)
            if converted is not MISSING:
                kwargs[f.name] = converted
            elif required:
                ok = False
            # else: the error is recorded and the default stands in, so later checks still run
        elif required:
            ctx.error((*path, name), "is required")
            ok = False
    return cls(**kwargs) if ok else MISSING
