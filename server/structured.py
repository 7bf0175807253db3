"""The request fields that constrain the output, as OpenAI, vLLM and SGLang name them, into one
`StructuredOutput` (docs: README, "Structured output"):

    response_format      OpenAI: {"type": "text" | "json_object"} or
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict",
                         "description"}}                                   (completions and chat)
    structured_outputs   vLLM: exactly one of {"json": schema, "regex": str, "choice": [str],
                         "grammar": EBNF}                                  (completions and chat)
    json_schema / regex / ebnf    SGLang, in /generate's sampling_params (one of them)

`response_format.json_schema.strict`: true or absent, only the properties and items the schema names
(xgrammar's strict mode, what vLLM and SGLang compile every schema with, so a user coming from them
sees the same output); false, any document the schema validates. `strict: true` said explicitly also
refuses a schema with a keyword that decoding does not enforce (`server.json_schemas`), as a
function's `strict` does. vLLM's and SGLang's own fields are strict, as they are there. At most one
constraint per request; each problem is a ProtocolError naming the field."""

from __future__ import annotations

import json

from compiled_engine.sampling_params import StructuredOutput
from server.json_schemas import remote_ref, unenforced
from server.request_errors import ProtocolError, check_fields
from server.schema_guard import check_pattern, check_schema

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})
STRUCTURED_OUTPUTS_FIELDS = frozenset({"json", "regex", "choice", "grammar"})
NATIVE_FIELDS = ("json_schema", "regex", "ebnf")


def openai_constraint(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """(constraint, the field it came from) of a completions or chat body."""
    found = [c for c in (_response_format(body), _structured_outputs(body)) if c[0] is not None]
    if len(found) > 1:
        raise ProtocolError(
            "'response_format' and 'structured_outputs' cannot both constrain one request",
            "structured_outputs",
        )
    return found[0] if found else (None, None)


def native_constraint(sp: dict) -> tuple[StructuredOutput | None, str | None]:
    """(constraint, field) of /generate's sampling_params."""
    present = [name for name in NATIVE_FIELDS if sp.get(name) is not None]
    if len(present) > 1:
        raise ProtocolError(
            f"at most one of {', '.join(NATIVE_FIELDS)} per request",
            f"sampling_params.{present[1]}",
        )
    if not present:
        return None, None
    name = present[0]
    where = f"sampling_params.{name}"
    if name == "json_schema":
        return StructuredOutput("json", _schema_text(sp[name], where)), where
    text = _string(sp[name], where)
    if name == "regex":
        check_pattern(text, where)
    return StructuredOutput("regex" if name == "regex" else "grammar", text), where


def _response_format(body: dict) -> tuple[StructuredOutput | None, str | None]:
    value = body.get("response_format")
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise ProtocolError("'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ProtocolError(
            f"'response_format.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}",
            "response_format.type",
        )
    check_fields(
        value,
        frozenset({"type", "json_schema"} if kind == "json_schema" else {"type"}),
        "response_format",
    )
    if kind == "text":
        return None, None
    if kind == "json_object":
        return StructuredOutput("json", ""), "response_format"
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ProtocolError(f"'{where}' must be an object with 'name' and 'schema'", where)
    check_fields(spec, JSON_SCHEMA_FIELDS, where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ProtocolError(f"'{where}.name' is required (a string)", f"{where}.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ProtocolError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    schema, strict = spec.get("schema"), spec.get("strict") is not False
    if isinstance(schema, dict):
        check_schema(schema, f"{where}.schema")
    if spec.get("strict") is True and isinstance(schema, dict):
        found = unenforced(schema, "schema")
        if found is not None:
            raise ProtocolError(
                f"'{where}.strict' cannot be honoured: constrained decoding does not enforce "
                f"{found[1]} (in {where}.{found[0][:100]}); drop it or set strict to false",
                f"{where}.strict",
            )
    where = f"{where}.schema"
    return StructuredOutput(
        "json", "" if schema is None else _schema_text(schema, where), strict
    ), where


def _structured_outputs(body: dict) -> tuple[StructuredOutput | None, str | None]:
    value = body.get("structured_outputs")
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise ProtocolError("'structured_outputs' must be an object", "structured_outputs")
    check_fields(value, STRUCTURED_OUTPUTS_FIELDS, "structured_outputs")
    present = [
        name for name in ("json", "regex", "choice", "grammar") if value.get(name) is not None
    ]
    if len(present) != 1:
        raise ProtocolError(
            "'structured_outputs' takes exactly one of json, regex, choice, grammar",
            "structured_outputs",
        )
    name = present[0]
    where = f"structured_outputs.{name}"
    if name == "json":
        return StructuredOutput("json", _schema_text(value[name], where)), where
    if name == "choice":
        choices = value[name]
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise ProtocolError(f"'{where}' must be a non-empty array of non-empty strings", where)
        return StructuredOutput("choice", tuple(choices)), where
    text = _string(value[name], where)
    if name == "regex":
        check_pattern(text, where)
    return StructuredOutput(name, text), where


def _schema_text(value: object, where: str) -> str:
    """A JSON schema given as an object (or as its JSON text) -> its text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ProtocolError(f"'{where}' is not valid JSON", where) from None
    if not isinstance(value, dict):
        raise ProtocolError(f"'{where}' must be a JSON schema object", where)
    check_schema(value, where)
    remote = remote_ref(value, where)
    if remote is not None:
        raise ProtocolError(
            f"'{remote}.$ref' must point inside the schema ('#/...'): nothing is fetched", where
        )
    return json.dumps(value)


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"'{where}' must be a non-empty string", where)
    return value
