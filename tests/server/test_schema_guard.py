"""`server.schema_guard`: a user's schema or regex is bounded before anything evaluates it (depth,
size, `$ref`s that lead back into themselves: a 400 naming the field, never a RecursionError), and
its patterns run in RE2, never in Python's backtracking `re`."""

from __future__ import annotations

import re

import jsonschema._keywords
import jsonschema._legacy_keywords
import jsonschema._utils
import pytest
from referencing import Registry

from server.request_errors import ProtocolError
from server.schema_guard import MAX_DEPTH, MAX_NODES, check_pattern, check_schema, validator_class


def _refused(schema: object, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as caught:
        check_schema(schema, "tools[0].function.parameters")
    assert caught.value.status == 400
    assert caught.value.param.startswith("tools[0].function.parameters")


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(("schema", "message"), [
    ({"$ref": "#"}, r"'tools\[0\].function.parameters.\$ref' leads back into itself"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
      "$ref": "#/$defs/n"}, "leads back into itself"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "leads back into itself"),
    (_nested(300), f"nested deeper than {MAX_DEPTH} levels"),
    ({"enum": list(range(MAX_NODES + 1))}, f"more than {MAX_NODES} values"),
    ({"type": "string", "pattern": r"(a)\1"}, r"\.pattern' is not a pattern this server evaluates"),
    ({"properties": {"s": {"pattern": "(?=a)"}}}, r"properties\.s\.pattern' is not a pattern"),
    ({"patternProperties": {"(?!x)": {}}}, r"patternProperties' is not a pattern"),
    ({"type": "string", "pattern": "a" * 2000}, "longer than 1024 characters"),
    ({"patternProperties": {"a": {}}, "unevaluatedProperties": False},
     "'unevaluatedProperties' in a schema with 'patternProperties'"),
    # a nested $schema would pick the stock validator (Python's re) for its subtree
    ({"properties": {"s": {"$schema": "http://json-schema.org/draft-07/schema#",
                           "pattern": "^(a+)+$"}}}, r"properties\.s\.\$schema' is not supported"),
    ({"$anchor": "r", "$ref": "#r"}, r"\$anchor' is not supported"),
    ({"$defs": {"a": {"$ref": "#/%24defs/a"}}, "$ref": "#/$defs/a"}, "leads back into itself"),
    ({"properties": {"enum": {"type": "string", "pattern": "(x)\\1"}}},
     r"properties\.enum\.pattern' is not a pattern"),
    ({"anyOf": [{"$ref": f"#/$defs/d{i}"} for i in range(300)]}, "more than 256 '\\$ref's"),
])
def test_a_schema_out_of_bounds_is_a_400_naming_the_field(schema, message) -> None:
    _refused(schema, message)


def test_what_stays_within_bounds_passes() -> None:
    check_schema(_nested(MAX_DEPTH // 2 - 1), "schema")  # two levels of JSON per schema level
    check_schema({"$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"},
                                                                     "b": {"$ref": "#/$defs/s"}}},
                 "schema")
    check_schema({"type": "string", "pattern": "^(a+)+$"}, "schema")  # RE2 runs it in linear time
    check_pattern(r"\d{3}-[a-z]+", "structured_outputs.regex")
    # data, not schemas: an enum of objects with "$ref" / "pattern" keys is no recursion or pattern
    check_schema({"enum": [{"$ref": "#"}, {"pattern": "(x)\\1"}], "default": {"$ref": "#"}},
                 "schema")
    check_schema({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string"},
                 "schema")


def test_patterns_never_reach_pythons_re(monkeypatch) -> None:
    """Every keyword that matches a pattern (`pattern`, `patternProperties`, and
    `additionalProperties` beside them) goes through RE2: Python's `re` is made to raise."""

    def refuse(*args, **kwargs):
        raise AssertionError("Python's backtracking re was called")

    for module in (jsonschema._keywords, jsonschema._utils, jsonschema._legacy_keywords):
        monkeypatch.setattr(module, "re", type("NoRe", (), {"search": refuse, "match": refuse,
                                                             "compile": refuse}))
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
              "patternProperties": {"^x-(a+)+$": {"type": "integer"}},
              "additionalProperties": False}
    check_schema(schema, "schema")
    valid = validator_class(schema)(schema, registry=Registry())
    hostile = "a" * 50_000 + "b"  # exponential in a backtracking engine
    assert not valid.is_valid({"s": hostile})
    assert valid.is_valid({"s": "aaa", "x-aa": 3})
    assert not valid.is_valid({"x-aa": "three"})
    assert not valid.is_valid({"x-" + hostile: 3})  # matches no pattern: an additional property
    assert not valid.is_valid({"other": 1})
    draft7 = schema | {"$schema": "http://json-schema.org/draft-07/schema#"}  # a legacy dialect
    check_schema(draft7, "schema")
    assert not validator_class(draft7)(draft7).is_valid({"s": hostile})
    assert re.search("^(a+)+$", "aaaa")  # (the real re, untouched outside jsonschema)
