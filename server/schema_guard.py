"""Bounds on what a user's JSON schema or regex may make the server do, checked before anything
evaluates it: nesting depth and size (validators and grammar builders recurse), `$ref`s that
lead back into themselves (a validator follows them forever), and patterns, which run in RE2
(linear time, no backreferences or lookaround) instead of Python's backtracking `re`. A schema or
regex out of bounds is a 400 naming the field."""

from __future__ import annotations

import functools
import urllib.parse

import re2
from jsonschema import Draft202012Validator, ValidationError, validators

from server.request_errors import ProtocolError

MAX_DEPTH = 32  # nesting of objects and arrays in a schema
MAX_NODES = 4096  # objects, arrays and values in a schema
MAX_REFS = 256  # `$ref`s in a schema (the cycle check is quadratic in them)
MAX_PATTERN_CHARS = 1024
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.max_mem = 2 << 20  # a pattern's compiled program (RE2 refuses a larger one)
_RE2_OPTIONS.log_errors = False  # a bad pattern is the client's 400, not a line in the log
# Keywords that would take validation out of this module's hands: a nested `$schema` picks the stock
# validator (Python's `re`) for its subtree; anchors, embedded resources and dynamic references
# resolve where the cycle check cannot follow.
ROOT_ONLY = ("$schema", "$id")
REFUSED = ("$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor")


def check_pattern(pattern: str, where: str) -> None:
    """400 unless RE2 compiles `pattern` within its limits."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ProtocolError(f"'{where}' is longer than {MAX_PATTERN_CHARS} characters", where)
    try:
        _compile(pattern)
    except re2.error as e:
        raise ProtocolError(
            f"'{where}' is not a pattern this server evaluates ({str(e)[:120]}): patterns run in "
            "RE2, linear time, without backreferences or lookaround",
            where,
        ) from None


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re2._Regexp:
    return re2.compile(pattern, _RE2_OPTIONS)


# Where a schema holds subschemas: keyword -> {name: schema}, [schema], or one schema (draft 2020-12
# and the older drafts' names)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
               "dependencies")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items", "additionalItems")
SCHEMA_ONES = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
               "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def check_schema(schema: object, where: str) -> None:
    """400 unless `schema` is within MAX_DEPTH and MAX_NODES, its patterns compile in RE2 and no
    local `$ref` leads back into itself. Iterative: no input can exhaust Python's stack here."""
    if _size(schema, MAX_DEPTH) > MAX_NODES:
        raise ProtocolError(f"'{where}' has more than {MAX_NODES} values or is nested deeper "
                            f"than {MAX_DEPTH} levels", where)
    pattern_properties, unevaluated = False, False
    refs: dict[str, str] = {}  # the JSON pointer of each `$ref` site -> where it points
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false, or not a schema (the metaschema check says so)
        field = f"{where}{_dotted(pointer)}"
        _check_keywords(node, field, at_root=not pointer)
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], f"{field}.pattern")
        if isinstance(node.get("patternProperties"), dict):
            for key in node["patternProperties"]:
                check_pattern(key, f"{field}.patternProperties")
        pattern_properties |= "patternProperties" in node
        unevaluated |= "unevaluatedProperties" in node
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            refs[pointer] = urllib.parse.unquote(node["$ref"][1:])
            if len(refs) > MAX_REFS:
                raise ProtocolError(f"'{where}' has more than {MAX_REFS} '$ref's", where)
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(v, f"{pointer}/{_escaped(key)}/{_escaped(k)}")
                          for k, v in node[key].items()]
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(v, f"{pointer}/{key}/{i}") for i, v in enumerate(node[key])]
        stack += [(node[key], f"{pointer}/{key}") for key in SCHEMA_ONES if key in node]
    if pattern_properties and unevaluated:
        raise ProtocolError(f"'{where}': 'unevaluatedProperties' in a schema with "
                            "'patternProperties' is not supported", where)
    cycle = _ref_cycle(refs)
    if cycle is not None:
        raise ProtocolError(
            f"'{where}{_dotted(cycle)}.$ref' leads back into itself: recursive schemas are not "
            "supported",
            where,
        )


def _check_keywords(node: dict, field: str, at_root: bool) -> None:
    for key in REFUSED + (() if at_root else ROOT_ONLY):
        if key in node:
            raise ProtocolError(f"'{field}.{key}' is not supported"
                                + ("" if key in REFUSED else " below the schema's root"), field)


def _size(value: object, max_depth: int) -> int:
    """How many values `value` holds (itself included), MAX_NODES + 1 once past MAX_NODES or
    `max_depth` levels; iteratively."""
    count, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_NODES or depth > max_depth:
            return MAX_NODES + 1
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) \
            else ()
        stack += [(child, depth + 1) for child in children]
    return count


def _ref_cycle(refs: dict[str, str]) -> str | None:
    """A `$ref` site from which following `$ref`s (into the subtree each one names) comes back to
    it, or None."""

    def inside(target: str) -> list[str]:  # the $ref sites in the subtree at `target`
        return [site for site in refs if site == target or site.startswith(target + "/")]

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in refs:
        if state.get(start):
            continue
        path = [(start, iter(inside(refs[start])))]
        state[start] = 1
        while path:
            site, following = path[-1]
            nxt = next(following, None)
            if nxt is None:
                state[site] = 2
                path.pop()
            elif state.get(nxt) == 1:
                return nxt
            elif not state.get(nxt):
                state[nxt] = 1
                path.append((nxt, iter(inside(refs[nxt]))))
    return None


def _escaped(key: object) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _dotted(pointer: str) -> str:
    return "".join(f".{part}" for part in pointer.split("/")[1:])[:200]


def _matched(pattern_properties: dict, name: str) -> bool:
    return any(_compile(pattern).search(name) for pattern in pattern_properties)


def _re2_pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _compile(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _re2_pattern_properties(validator, pattern_properties, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for name, value in instance.items():
            if _compile(pattern).search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _re2_additional_properties(validator, additional, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    declared, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = sorted(n for n in instance if n not in declared and not _matched(patterns, n))
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        yield ValidationError(f"additional properties are not allowed: {extras[:8]}")


@functools.cache
def _with_re2(base: type) -> type:
    return validators.extend(base, {"pattern": _re2_pattern,
                                    "patternProperties": _re2_pattern_properties,
                                    "additionalProperties": _re2_additional_properties})


def validator_class(schema: dict) -> type:
    """The schema's jsonschema validator class, its pattern keywords evaluated by RE2 (a schema
    that passed `check_schema`: every pattern compiles)."""
    return _with_re2(validators.validator_for(schema, default=Draft202012Validator))
