"""The published OpenAPI descriptions (docs/openapi-*.json) and hypothesis strategies from them.

:func:`from_schema` turns the subset of JSON Schema the documents use (``$ref``, ``type``,
``enum``, ``properties`` / ``required``, ``items`` / ``minItems``, ``minimum`` / ``maximum``,
``oneOf``) into a strategy of conforming values, so the fuzz tests draw their valid requests
from what the documents promise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

DOCS = Path(__file__).resolve().parents[2] / "docs"
METHODS = ("get", "post", "put", "patch", "delete")


def load(name: str) -> dict[str, Any]:
    """``docs/openapi-<name>.json``."""
    document: dict[str, Any] = json.loads((DOCS / f"openapi-{name}.json").read_text())
    return document


def operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    """Every documented ``(METHOD, path)``."""
    return {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in METHODS
    }


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = document["components"]["schemas"][name]
    return schema


def request_schema(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    body = document["paths"][path][method.lower()]["requestBody"]
    return resolve(document, body["content"]["application/json"]["schema"])


_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)


def from_schema(
    document: dict[str, Any],
    schema: dict[str, Any],
    overrides: dict[str, st.SearchStrategy[Any]] | None = None,
) -> st.SearchStrategy[Any]:
    """Values conforming to ``schema``; ``overrides`` replace the strategy of named properties."""
    overrides = overrides or {}
    schema = resolve(document, schema)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema and "type" not in schema and "properties" not in schema:
        return st.one_of([from_schema(document, s, overrides) for s in schema["oneOf"]])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        return st.one_of([from_schema(document, {**schema, "type": k}, overrides) for k in kind])
    if kind == "object":
        return _object(document, schema, overrides)
    if kind == "array":
        items = from_schema(document, schema.get("items", {"type": "string"}), overrides)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=4)
    if kind == "string":
        return _TEXT
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**31)), schema.get("maximum", 2**31))
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    raise ValueError(f"unsupported schema {schema!r}")


def _object(
    document: dict[str, Any], schema: dict[str, Any], overrides: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties", {})
    if not properties:
        return st.fixed_dictionaries({})
    required = set(schema.get("required", ()))
    # "oneOf": [{"required": [...]}, ...] -- exactly one of these properties
    choices = [set(s["required"]) for s in schema.get("oneOf", ()) if "required" in s]
    exclusive = set().union(*choices) if choices else set()

    def strategy(name: str) -> st.SearchStrategy[Any]:
        if name in overrides:
            return overrides[name]
        return from_schema(document, properties[name], overrides)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        chosen = draw(st.sampled_from(choices)) if choices else set()
        out: dict[str, Any] = {}
        for name in properties:
            if name in exclusive and name not in chosen:
                continue
            if name in required or name in chosen or draw(st.booleans()):
                out[name] = draw(strategy(name))
        return out

    return build()
