"""Bounds on what a user's JSON schema or regex may make the server do, checked before anything
evaluates it: nesting depth and size (validators and grammar builders recurse), `$ref`s that
lead back into themselves (a validator follows them forever), and patterns, which run in RE2
(linear time, no backreferences or lookaround) instead of Python's backtracking `re`. A schema or
regex out of bounds is a 400 naming the field."""

from __future__ import annotations

import functools

import re2
from jsonschema import Draft202012Validator, ValidationError, validators

from server.request_errors import ProtocolError

MAX_DEPTH = 32  # nesting of objects and arrays in a schema
MAX_NODES = 4096  # objects, arrays and values in a schema
MAX_PATTERN_CHARS = 1024
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.max_mem = 8 << 20  # a pattern's compiled program (RE2 refuses a larger one)


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


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> re2._Regexp:
    return re2.compile(pattern, _RE2_OPTIONS)


def check_schema(schema: object, where: str) -> None:
    """400 unless `schema` is within MAX_DEPTH and MAX_NODES, its patterns compile in RE2 and no
    local `$ref` leads back into itself. Iterative: no input can exhaust Python's stack here."""
    nodes, pattern_properties, unevaluated = 0, False, False
    refs: dict[str, str] = {}  # the JSON pointer of each `$ref` site -> where it points
    stack: list[tuple[object, str, int]] = [(schema, "", 0)]
    while stack:
        node, pointer, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ProtocolError(f"'{where}' has more than {MAX_NODES} values", where)
        if depth > MAX_DEPTH:
            raise ProtocolError(f"'{where}' is nested deeper than {MAX_DEPTH} levels", where)
        if isinstance(node, dict):
            field = f"{where}{_dotted(pointer)}"
            if isinstance(node.get("pattern"), str):
                check_pattern(node["pattern"], f"{field}.pattern")
            if isinstance(node.get("patternProperties"), dict):
                for key in node["patternProperties"]:
                    check_pattern(key, f"{field}.patternProperties")
            pattern_properties |= "patternProperties" in node
            unevaluated |= "unevaluatedProperties" in node
            if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
                refs[pointer] = node["$ref"][1:]
            stack += [(v, f"{pointer}/{_escaped(k)}", depth + 1) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{pointer}/{i}", depth + 1) for i, v in enumerate(node)]
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
