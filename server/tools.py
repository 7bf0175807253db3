"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools go to the chat template (`apply_chat_template(tools=...)`). What the model answers becomes
`message.tool_calls`:
    auto       the output is parsed in its model family's format (the parser: from the chat
               template, or `--tool-call-parser`): hermes (Hermes, Qwen: `<tool_call>{"name",
               "arguments"}</tool_call>`), llama3_json (Llama 3.x: a `{"name", "parameters"}`
               object, after `<|python_tag|>` or alone), mistral (`[TOOL_CALLS][{"name",
               "arguments"}, ...]`); text outside the calls stays content
    required   the output is constrained to a JSON array of calls `[{"name", "parameters"}]` (one
               call unless parallel_tool_calls, then up to 8), each validated by its function's JSON
               schema
    named      (`{"type": "function", "function": {"name": ...}}`) the output is constrained to that
               function's parameters
    none       no calls: the output is content
A call is returned only when it names a function of the request and its arguments validate against
that function's `parameters` (jsonschema; with `strict: true`, objects that list `properties` are
closed, as the required and named constraints close them); any other output stays content, with the
engine's finish reason (`stop`, or `length` when max_tokens cut it). `parallel_tool_calls: false`
keeps the first call. A response with calls has `finish_reason: "tool_calls"`."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema
from referencing import Registry
from referencing.exceptions import Unresolvable

from compiled_engine.sampling_params import StructuredOutput
from server.json_schemas import closed_schema, remote_ref, unenforced
from server.request_errors import ProtocolError, check_fields
from server.schema_guard import check_schema, validator_class

PARSERS = ("hermes", "llama3_json", "mistral")
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's limit: each schema is checked on the event loop
MAX_PARALLEL_CALLS = 8  # calls in one `required` answer (so that even a weak model's answer ends)
@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict
    strict: bool = False

    def accepts(self, arguments: object) -> bool:
        """Whether `arguments` validate against the parameters (strict: with their objects
        closed)."""
        schema = closed_schema(self.parameters) if self.strict else self.parameters
        try:  # an empty registry: a $ref resolves inside the schema or not at all (never fetched)
            return validator_class(schema)(schema, registry=Registry()).is_valid(arguments)
        except (Unresolvable, RecursionError):  # a $ref the schema does not hold; a last guard
            return False


@dataclass
class ToolRequest:
    functions: list[Function]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True

    def template_tools(self) -> list[dict]:
        return [
            {
                "type": "function",
                "function": {
                    "name": f.name,
                    "description": f.description or "",
                    "parameters": f.parameters,
                },
            }
            for f in self.functions
        ]

    def constraint(self) -> StructuredOutput | None:
        """The constraint that makes the output a parseable call (required, named), else None."""
        if self.choice == "named":
            return StructuredOutput("json", json.dumps(self._function(self.named).parameters))
        if self.choice != "required":
            return None
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                    "required": ["name", "parameters"],
                }
                for f in self.functions
            ]
        }
        array = {
            "type": "array",
            "items": calls,
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1,
        }
        return StructuredOutput("json", json.dumps(array))

    def _function(self, name: str | None) -> Function:
        return next(f for f in self.functions if f.name == name)

    def call(self, obj: object, args_key: str) -> ToolCall | None:
        """The call `obj` ({"name", args_key: arguments object or its JSON text}) makes; None unless
        it names a function of the request and its arguments are an object that validates."""
        if not isinstance(obj, dict) or obj.get("name") not in {f.name for f in self.functions}:
            return None
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):
            args = _loads(args)
        if not isinstance(args, dict) or not self._function(obj["name"]).accepts(args):
            return None
        return ToolCall(obj["name"], json.dumps(args))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_request(body: dict) -> ToolRequest | None:
    """The tools of a chat body (None without any); ProtocolError naming the field for anything
    wrong."""
    tools, choice, parallel = (
        body.get("tools"),
        body.get("tool_choice"),
        body.get("parallel_tool_calls"),
    )
    if tools is None:
        if choice not in (None, "none"):
            raise ProtocolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ProtocolError("'tools' must be a non-empty array", "tools")
    if len(tools) > MAX_TOOLS:
        raise ProtocolError(f"'tools' has {len(tools)} functions; at most {MAX_TOOLS} are allowed",
                            "tools")
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ProtocolError("'tools' has two functions with one name", "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    req = ToolRequest(functions, "auto", parallel=True if parallel is None else parallel)
    if choice is None or choice in ("none", "auto", "required"):
        req.choice = choice or "auto"
        return req
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(choice.get("function"), dict)
    ):
        raise ProtocolError(
            "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
            "{\"name\": ...}}",
            "tool_choice",
        )
    name = choice["function"].get("name")
    if name not in names:
        raise ProtocolError(
            f"'tool_choice' names {str(name)[:64]!r}, which is not in 'tools'", "tool_choice"
        )
    req.choice, req.named = "named", name
    return req


def _function(tool: object, where: str) -> Function:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise ProtocolError(
            f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where
        )
    check_fields(tool, TOOL_FIELDS, where)
    fn = tool["function"]
    check_fields(fn, FUNCTION_FIELDS, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ProtocolError(f"'{where}.function.name' is required: 1-64 letters, digits, _ or -",
                            f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ProtocolError(
            f"'{where}.function.description' must be a string", f"{where}.function.description"
        )
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ProtocolError(f"'{where}.function.parameters' must be a JSON schema object",
                            f"{where}.function.parameters")
    check_schema(parameters, f"{where}.function.parameters")  # before anything walks it
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise ProtocolError(
            f"'{where}.function.parameters' is not a valid JSON schema: {e.message[:200]}",
            f"{where}.function.parameters",
        ) from None
    remote = remote_ref(parameters, "parameters")
    if remote is not None:
        raise ProtocolError(
            f"'{where}.function.{remote}.$ref' must point inside the schema ('#/...'): "
            "nothing is fetched",
            f"{where}.function.parameters",
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ProtocolError(
            f"'{where}.function.strict' must be a boolean", f"{where}.function.strict"
        )
    if strict:
        _check_strict(parameters, where)
    return Function(name, description, parameters, bool(strict))


def _check_strict(parameters: dict, where: str) -> None:
    """400 naming `strict` when the schema says something constrained decoding does not enforce."""
    found = unenforced(parameters, "parameters")
    if found is not None:
        raise ProtocolError(
            f"'{where}.function.strict' cannot be honoured: constrained decoding does not enforce "
            f"{found[1]} (in {where}.function.{found[0][:100]}); drop it or set strict to false",
            f"{where}.function.strict",
        )


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def extract_calls(req: ToolRequest, text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output. Only calls to the request's functions whose arguments
    validate are returned (the first of them without parallel_tool_calls); any other output stays
    content."""
    if req.choice == "none":
        return text, []
    if req.choice == "named":
        content, calls = _named(req, text)
    elif req.choice == "required":
        content, calls = _required(req, text)
    else:
        content, calls = _PARSE[parser](text, req.call)
    return content, calls if req.parallel else calls[:1]


def _loads(text: str) -> object:
    """The JSON value of `text`; None when it is not JSON (a cut output, say)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _named(req: ToolRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    call = req.call({"name": req.named, "arguments": _loads(text)}, "arguments")
    return (None, [call]) if call is not None else (text, [])


def _required(req: ToolRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    items = _loads(text)
    return _all_or_none(
        None, text, items if isinstance(items, list) else [None], req.call, "parameters"
    )


Check = Callable[[object, str], ToolCall | None]  # ToolRequest.call


def _all_or_none(content: str | None, text: str, items: list, check: Check,
                 args_key: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) when every item is a valid call; else (text, []): one JSON document of calls
    is taken whole or left as content."""
    calls = [check(v, args_key) for v in items]
    return (content, calls) if calls and None not in calls else (text, [])


def _hermes(text: str, check: Check) -> tuple[str | None, list[ToolCall]]:
    """Each `<tool_call>` block that holds a valid call becomes that call; the rest of the text is
    content."""
    calls = []

    def take(m: re.Match) -> str:
        call = check(_loads(m.group(1).strip()), "arguments")
        if call is None:
            return m.group(0)
        calls.append(call)
        return ""

    content = re.sub(r"<tool_call>(.*?)(?:</tool_call>|$)", take, text, flags=re.S)
    if not calls:
        return text, []
    return content.strip() or None, calls


def _llama3_json(text: str, check: Check) -> tuple[str | None, list[ToolCall]]:
    value = _loads(text.split("<|python_tag|>", 1)[-1].strip())
    return _all_or_none(
        None, text, value if isinstance(value, list) else [value], check, "parameters"
    )


def _mistral(text: str, check: Check) -> tuple[str | None, list[ToolCall]]:
    head, sep, body = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    value = _loads(body.strip())
    return _all_or_none(
        head.strip() or None,
        text,
        value if isinstance(value, list) else [value],
        check,
        "arguments",
    )


_PARSE = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
