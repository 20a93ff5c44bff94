"""A JSON Schema checker for the subset the constrained-decoding tests use (no dependency)."""

from __future__ import annotations

from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def errors(value: Any, schema: dict, where: str = "$") -> list[str]:
    out: list[str] = []
    t = schema.get("type")
    if t == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t == "number":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif t is not None:
        ok = isinstance(value, _TYPES[t]) and not (t != "boolean" and isinstance(value, bool))
    else:
        ok = True
    if not ok:
        return [f"{where}: {value!r} is not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        out.append(f"{where}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        out.append(f"{where}: {value} > {schema['maximum']}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        out.append(f"{where}: longer than {schema['maxLength']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: missing {r}" for r in schema.get("required", []) if r not in value]
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: unexpected {k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += errors(v, schema["items"], f"{where}[{i}]")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{where}: more than {schema['maxItems']} items")
    return out
