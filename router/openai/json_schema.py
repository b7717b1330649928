"""JSON Schema rules the service applies to a caller's schema before it becomes a grammar:
OpenAI's strict-mode checks, and closing objects so that a small model cannot wander into
invented keys. Used for ``response_format`` and for tool parameters alike."""

from __future__ import annotations

from typing import Any

from router.errors import BadRequestError

__all__ = ["check_strict_schema", "close_objects"]


def _schema_error(name: str, where: str, why: str) -> BadRequestError:
    return BadRequestError(
        f"Invalid schema for response_format '{name}': In context={where}, {why}.",
        param="response_format.json_schema.schema",
        code="invalid_json_schema",
    )


def check_strict_schema(schema: Any, name: str, path: tuple[str, ...] = ()) -> None:
    """OpenAI's strict-mode rules: every object lists all its properties as ``required`` and sets
    ``additionalProperties: false`` (what makes "the output validates" a guarantee)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_strict_schema(item, name, (*path, str(i)))
        return
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types)
    if is_object or "properties" in schema:
        where = "(" + ", ".join(repr(p) for p in path) + ")"
        if schema.get("additionalProperties") is not False:
            why = "'additionalProperties' is required to be supplied and to be false"
            raise _schema_error(name, where, why)
        props = list((schema.get("properties") or {}).keys())
        missing = [p for p in props if p not in (schema.get("required") or [])]
        if missing:
            raise _schema_error(
                name,
                where,
                f"'required' is required to be supplied and to be an array including every key "
                f"in properties. Missing '{missing[0]}'",
            )
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for sub, subschema in value.items():
                check_strict_schema(subschema, name, (*path, key, sub))
        elif key in ("items", "anyOf", "allOf", "oneOf", "prefixItems", "additionalProperties"):
            check_strict_schema(value, name, (*path, key))


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which objects that list ``properties`` but leave
    ``additionalProperties`` unset allow no other keys. JSON Schema's default admits any extra key,
    and under a grammar a small model wanders into inventing keys until ``max_tokens``; every
    output of the closed schema still validates against the original."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}  # names, not schemas
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value
        else:
            out[key] = close_objects(value)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
