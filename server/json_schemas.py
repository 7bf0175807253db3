"""What constrained decoding (xgrammar) enforces of a JSON schema, for the fields that promise a
schema is followed exactly (`tools[].function.strict`, `response_format.json_schema.strict`): the
keywords it does not enforce, the schema as its strict mode reads it, and `$ref`s that point outside
the schema (never fetched)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

# Keywords the constrained decoder (xgrammar) does not enforce: `strict: true` refuses them (a 400)
# rather than promise arguments it cannot make follow the schema exactly (as it refuses an `allOf`
# of several schemas, which xgrammar reads as any value, and constraints beside a REPLACING_KEYWORDS
# one).
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
)
# A node with one of these is read as that keyword alone: any other constraint beside it is not
# enforced.
REPLACING_KEYWORDS = ("$ref", "anyOf", "oneOf", "allOf")
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$defs",
        "definitions",
        "$schema",
        "$id",
    }
)
# keyword -> {name: subschema}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # keyword -> [subschema]
_SCHEMA_ONES = ("items", "additionalProperties")  # keyword -> subschema


def _unenforced_here(node: dict) -> str | None:
    """What of this schema node (its subschemas aside) constrained decoding would not enforce, or
    None."""
    found = [k for k in UNENFORCED_KEYWORDS if k in node] + (
        ["uniqueItems"] if node.get("uniqueItems") else []
    )
    if found:
        return f"'{found[0]}'"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema"
    for key in REPLACING_KEYWORDS:
        beside = sorted(set(node) - ANNOTATIONS - {key}) if key in node else []
        if beside:
            return f"'{beside[0]}' beside '{key}'"
    return None


def _subschemas(schema: dict, path: str) -> Iterator[tuple[str, dict]]:
    """(path, node) of `schema` and of every subschema in it, depth first."""
    yield path, schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if isinstance(sub, dict):
                    yield from _subschemas(sub, f"{path}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if isinstance(sub, dict):
                    yield from _subschemas(sub, f"{path}.{key}[{i}]")
    for key in _SCHEMA_ONES:
        if isinstance(schema.get(key), dict):
            yield from _subschemas(schema[key], f"{path}.{key}")


def closed_schema(schema: dict) -> dict:
    """`schema` as strict output reads it (xgrammar's strict mode): an object schema that lists
    `properties` admits no others unless it says so, and a `prefixItems` array no further items."""
    out = copy.deepcopy(schema)
    for _, node in list(_subschemas(out, "")):
        if (
            "properties" in node
            and "additionalProperties" not in node
            and "patternProperties" not in node
        ):
            node["additionalProperties"] = False
        if "prefixItems" in node and "items" not in node:
            node["items"] = False
    return out


def unenforced(schema: dict, path: str) -> tuple[str, str] | None:
    """(path of the node, what) for the first thing in `schema` that constrained decoding would not
    enforce."""
    for where, node in _subschemas(schema, path):
        found = _unenforced_here(node)
        if found is not None:
            return where, found
    return None


def remote_ref(schema: dict, path: str) -> str | None:
    """The path of the first node whose `$ref` points outside the schema (anything but '#...'), or
    None."""
    return next((where for where, node in _subschemas(schema, path)
                 if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#")), None)
