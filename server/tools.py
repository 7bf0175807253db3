"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools go to the chat template (`apply_chat_template(tools=...)`). What the model answers becomes
`message.tool_calls`:
    auto       the output is parsed in its model family's format (the parser: from the chat template, or
               `--tool-call-parser`): hermes (Hermes, Qwen: `<tool_call>{"name", "arguments"}</tool_call>`),
               llama3_json (Llama 3.x: a `{"name", "parameters"}` object, after `<|python_tag|>` or alone),
               mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`); text outside the calls stays content
    required   the output is constrained to a JSON array of calls `[{"name", "parameters"}]` (one call
               unless parallel_tool_calls, then up to 8), each validated by its function's JSON schema
    named      (`{"type": "function", "function": {"name": ...}}`) the output is constrained to that
               function's parameters
    none       no calls: the output is content
A response with calls has `finish_reason: "tool_calls"`."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from compiled_engine.scheduler.sampling_params import StructuredOutput
from server.request_errors import ProtocolError, check_fields

PARSERS = ("hermes", "llama3_json", "mistral")
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_PARALLEL_CALLS = 8  # calls in one `required` answer (so that even a weak model's answer ends)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict


@dataclass
class ToolRequest:
    functions: list[Function]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": {"name": f.name, "description": f.description or "",
                                                  "parameters": f.parameters}} for f in self.functions]

    def constraint(self) -> StructuredOutput | None:
        """The constraint that makes the output a parseable call (required, named), else None."""
        if self.choice == "named":
            return StructuredOutput("json", json.dumps(self._function(self.named).parameters))
        if self.choice != "required":
            return None
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                            "required": ["name", "parameters"]} for f in self.functions]}
        array = {"type": "array", "items": calls, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
        return StructuredOutput("json", json.dumps(array))

    def _function(self, name: str | None) -> Function:
        return next(f for f in self.functions if f.name == name)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_request(body: dict) -> ToolRequest | None:
    """The tools of a chat body (None without any); ProtocolError naming the field for anything wrong."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ProtocolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ProtocolError("'tools' must be a non-empty array", "tools")
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
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise ProtocolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "tool_choice")
    name = choice["function"].get("name")
    if name not in names:
        raise ProtocolError(f"'tool_choice' names {str(name)[:64]!r}, which is not in 'tools'", "tool_choice")
    req.choice, req.named = "named", name
    return req


def _function(tool: object, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ProtocolError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    check_fields(tool, TOOL_FIELDS, where)
    fn = tool["function"]
    check_fields(fn, FUNCTION_FIELDS, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ProtocolError(f"'{where}.function.name' is required: 1-64 letters, digits, _ or -",
                            f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ProtocolError(f"'{where}.function.description' must be a string", f"{where}.function.description")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ProtocolError(f"'{where}.function.parameters' must be a JSON schema object",
                            f"{where}.function.parameters")
    return Function(name, description, parameters)


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def extract_calls(req: ToolRequest, text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output."""
    if req.choice == "none":
        return text, []
    if req.choice == "named":
        return None, [ToolCall(req.named, _compact(text))]
    if req.choice == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut off by max_tokens: no call
        return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in calls]
    return _PARSE[parser](text, {f.name for f in req.functions})


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except json.JSONDecodeError:
        return text


def _call(obj: object, names: set[str], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S):
        try:
            call = _call(json.loads(body.strip()), names, "arguments")
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip()
    return content or None, calls


def _llama3_json(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    body = text.split("<|python_tag|>", 1)[-1].strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = [c for c in (_call(v, names, "parameters") for v in items) if c is not None]
    return (None, calls) if calls and len(calls) == len(items) else (text, [])


def _mistral(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    head, sep, body = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = [c for c in (_call(v, names, "arguments") for v in items) if c is not None]
    return (head.strip() or None, calls) if calls else (text, [])


_PARSE = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
