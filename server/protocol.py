"""Validation of the OpenAI-style request bodies into plain data. Every problem raises
`ProtocolError` naming the field (the app turns it into a 400 in the OpenAI error shape)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from compiled_engine.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_CACHE_SALT_CHARS,
    SAMPLING_RANGES,
    SamplingParams,
    StructuredOutput,
)
from server.request_errors import ProtocolError, check_defaults, check_fields
from server.structured import native_constraint, openai_constraint
from server.tools import ToolRequest, parse_tool_request

MAX_PROMPTS = 64
MAX_STOPS = 16
MAX_STOP_CHARS = 256  # each stop string: what the detokenizer holds back and scans per token
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# The fields each body may carry. Any other field that is present (not null) is answered with a 400
# naming it: a field the server does not implement is never silently ignored. `user` is OpenAI's
# end-user id for abuse monitoring, which asks for no behaviour.
SAMPLING_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "min_tokens", "stop", "n",
    # keep a matched stop string in the output: vLLM's name, and SGLang's (which routers send)
    "include_stop_str_in_output", "no_stop_trim",
    # vLLM's request priority (lower is sooner; /generate takes SGLang's at the top level)
    "priority",
    # vLLM's prefix-cache partition: requests share cached prompt pages only with the same salt
    "cache_salt"})
# Fields the field's routers (sglang-router, vllm-router) add to every request they forward,
# accepted where they ask for what this server does anyway (any other value: a 400 naming it).
ROUTER_DEFAULTS: dict[str, object] = {"return_hidden_states": False, "skip_special_tokens": True}
CHAT_ROUTER_DEFAULTS = ROUTER_DEFAULTS | {"continue_final_message": False}
# With --reasoning-parser: SGLang's (split the thinking out; stream it as it comes) and vLLM's
# (return it at all). Without a parser they ask for nothing (as in SGLang and vLLM without one).
REASONING_FIELDS = frozenset({"separate_reasoning", "stream_reasoning", "include_reasoning"})
NATIVE_ROUTER_DEFAULTS: dict[str, object] = {
    "return_hidden_states": False, "return_logprob": False, "log_metrics": True,
    "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
_COMMON_FIELDS = SAMPLING_FIELDS | {
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "user",
    "response_format",
    "structured_outputs",
}
COMPLETION_FIELDS = _COMMON_FIELDS | set(ROUTER_DEFAULTS) | {"prompt", "best_of", "logprobs",
                                                            "echo", "prompt_logprobs"}
CHAT_FIELDS = _COMMON_FIELDS | set(CHAT_ROUTER_DEFAULTS) | REASONING_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "prompt_logprobs",
    "chat_template_kwargs",
    "thinking_token_budget",
}
NATIVE_FIELDS = frozenset({"text", "input_ids", "sampling_params", "stream", "model",
                           "return_text_in_logprobs", "lora_path", "priority",
                           *NATIVE_ROUTER_DEFAULTS})
NATIVE_SAMPLING_FIELDS = SAMPLING_FIELDS | {
    "max_new_tokens",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "json_schema",
    "regex",
    "ebnf",
}
STREAM_OPTIONS_FIELDS = frozenset({"include_usage"})
MESSAGE_FIELDS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class Limits:
    max_context: int
    vocab_size: int


@dataclass
class GenerationRequest:
    """What the completions, chat and native endpoints share once validated."""

    params: SamplingParams  # n and the sampling fields; max_tokens resolved per prompt later
    max_tokens: int | None  # None: the endpoint's default
    max_tokens_param: str
    structured_param: str | None = None  # the field the output constraint came from (for its 400s)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    lora_path: str | None = None  # /generate (SGLang): a loaded adapter's name or path


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[Prompt] | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field (the engine's may be more: echo's logprobs)


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] | None = None
    logprobs: bool = False
    tools: ToolRequest | None = None
    prompt_logprobs: int | None = None  # vLLM's: the templated prompt's tokens' log-probs
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # chat_template_kwargs
    thinking_budget: int | None = None  # thinking_token_budget (vLLM's)
    reasoning: ReasoningOptions = dataclasses.field(default_factory=lambda: ReasoningOptions())


@dataclass(frozen=True, slots=True)
class ReasoningOptions:
    """What a request asks of the reasoning parser (each true by default)."""

    separate: bool = True  # SGLang's separate_reasoning: the thinking apart from the answer
    stream: bool = True  # SGLang's stream_reasoning: streamed as it comes (else whole, at once)
    include: bool = True  # vLLM's include_reasoning: returned at all


# apply_chat_template's own arguments, and what encode_chat passes it: not the template's variables
TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs_of(value: object, name: str = "chat_template_kwargs") -> dict:
    """The chat template's variables: an object whose keys are identifiers (not the arguments of
    apply_chat_template itself)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"'{name}' must be an object, got {_type_name(value)}", name)
    for key in value:
        if not key.isidentifier() or key.startswith("_") or key in TEMPLATE_RESERVED:
            raise ProtocolError(f"'{name}' cannot set {key[:64]!r}: a chat template variable is "
                                "an identifier, not one of apply_chat_template's arguments", name)
    return value


# ---- field readers -------------------------------------------------------------------------------
def check_text(value: object, where: str = "") -> None:
    """400 naming the first string (or object key) in a parsed JSON body that is not valid Unicode
    text: a lone UTF-16 surrogate (JSON "\\ud800") decodes to a str that has no UTF-8 form, so no
    tokenizer, detokenizer or stop-string match could handle it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(
                f"'{where or 'body'}' is not valid text: it holds a lone UTF-16 surrogate",
                where or None,
            ) from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, (int, float)):
                check_text(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, where or "body")
            check_text(item, f"{where}.{key}" if where else key)


def _type_name(value: object) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def get_int(
    body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:  # absent or null: the default
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{name}' must be an integer, got {_type_name(value)}", name)
    _check_range(name, value, lo, hi)
    return value


def get_float(
    body: dict,
    name: str,
    default: float,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:  # absent or null: the default
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"'{name}' must be a number, got {_type_name(value)}", name)
    value = float(value) if abs(value) < 1e300 else math.inf
    if not math.isfinite(value):
        raise ProtocolError(f"'{name}' must be a finite number", name)
    if lo_open and lo is not None and value <= lo:
        raise ProtocolError(f"'{name}' must be > {lo}, got {value}", name)
    _check_range(name, value, lo, hi)
    return value


def get_bool(body: dict, name: str, default: bool) -> bool:
    return _get_typed(body, name, default, bool, "a boolean")


def get_str(body: dict, name: str, default: str | None) -> str | None:
    return _get_typed(body, name, default, str, "a string")


def _get_typed(body: dict, name: str, default, kind: type, what: str):
    value = body.get(name)
    if value is None:  # absent or null: the default
        return default
    if not isinstance(value, kind):
        raise ProtocolError(f"'{name}' must be {what}, got {_type_name(value)}", name)
    return value


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        shown = value if abs(value) < 1e18 else f"{str(value)[:12]}..."
        bounds = (
            f"in [{lo}, {hi}]"
            if lo is not None and hi is not None
            else (f">= {lo}" if hi is None else f"<= {hi}")
        )
        raise ProtocolError(f"'{name}' must be {bounds}, got {shown}", name)


def token_ids(value: object, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ProtocolError(f"'{name}' must be a list of integer token ids", name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(
            f"'{name}' has token id {str(bad[0])[:24]} outside the vocabulary [0, {vocab_size})",
            name,
        )
    return value


# ---- sampling ------------------------------------------------------------------------------------


def _sampling_float(body: dict, name: str, default: float) -> float:
    """A float sampling field, in its range of the engine's table (`SAMPLING_RANGES`)."""
    allowed = SAMPLING_RANGES[name]
    return get_float(body, name, default, allowed.lo, allowed.hi, allowed.lo_open)


def sampling_int(body: dict, name: str, default: int | None, like: str | None = None) -> int | None:
    """An integer sampling field, in the range of the engine's table for `like` (default: its
    own name)."""
    allowed = SAMPLING_RANGES[like or name]
    return get_int(body, name, default, int(allowed.lo), int(allowed.hi))


def sampling_params(body: dict, limits: Limits, logprobs: int | None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """The sampling fields shared by every endpoint (max_tokens is resolved later, per prompt)."""
    temperature = _sampling_float(body, "temperature", 1.0)
    if temperature < 1e-5:
        temperature = 0.0  # a vanishing temperature is greedy (and dividing by it would overflow)
    seed = get_int(body, "seed", None, -(2**63), 2**64 - 1)
    return SamplingParams(
        max_tokens=0,
        temperature=temperature,
        top_p=_sampling_float(body, "top_p", 1.0),
        top_k=sampling_int(body, "top_k", -1),
        min_p=_sampling_float(body, "min_p", 0.0),
        seed=None if seed is None else seed % 2**63,
        presence_penalty=_sampling_float(body, "presence_penalty", 0.0),
        frequency_penalty=_sampling_float(body, "frequency_penalty", 0.0),
        repetition_penalty=_sampling_float(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body, limits.vocab_size),
        logprobs=logprobs,
        stop_token_ids=tuple(_stop_token_ids(body, limits.vocab_size)),
        ignore_eos=get_bool(body, "ignore_eos", False),
        min_tokens=get_int(body, "min_tokens", 0, 0, limits.max_context),
        stop=_stop(body),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False)
        or get_bool(body, "no_stop_trim", False),
        n=sampling_int(body, "n", 1),
        structured=structured,
        priority=get_int(body, "priority", 0, -(2**31), 2**31 - 1),
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: a non-empty string, bounded (`MAX_CACHE_SALT_CHARS`)."""
    salt = get_str(body, "cache_salt", None)
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ProtocolError(f"'cache_salt' must be a non-empty string of at most "
                            f"{MAX_CACHE_SALT_CHARS} characters, got {len(salt)}", "cache_salt")
    return salt


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(
            "'logit_bias' must be an object mapping token ids to biases", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tok = int(key)
        except ValueError:
            raise ProtocolError(
                f"'logit_bias' key {key[:24]!r} is not a token id", "logit_bias"
            ) from None
        if not 0 <= tok < vocab_size:
            raise ProtocolError(
                f"'logit_bias' token id {key[:24]} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        out[tok] = get_float({"logit_bias": bias}, "logit_bias", 0.0, LOGIT_BIAS_RANGE.lo,
                             LOGIT_BIAS_RANGE.hi)
    return out or None


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    value = body.get("stop_token_ids")
    return [] if value is None else token_ids(value, "stop_token_ids", vocab_size)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ProtocolError("'stop' must be a string or a list of strings", "stop")
    if len(value) > MAX_STOPS:
        raise ProtocolError(
            f"'stop' has {len(value)} strings; at most {MAX_STOPS} are allowed", "stop"
        )
    for i, s in enumerate(value):
        if len(s) > MAX_STOP_CHARS:
            raise ProtocolError(f"'stop[{i}]' is longer than {MAX_STOP_CHARS} characters", "stop")
    return tuple(s for s in value if s)


def resolve_max_tokens(
    req: GenerationRequest, prompt_len: int, limits: Limits, default: int | None
) -> int:
    """The request's max_tokens for a prompt of `prompt_len` tokens; 400 when it cannot fit the
    context."""
    room = limits.max_context - prompt_len
    if room < 1:
        raise ProtocolError(
            f"the prompt has {prompt_len} tokens but the context limit is {limits.max_context}; "
            "shorten the prompt", "messages" if isinstance(req, ChatRequest) else "prompt")
    if req.max_tokens is None:
        return room if default is None else min(default, room)
    if req.max_tokens > room:
        raise ProtocolError(
            f"'{req.max_tokens_param}' is {req.max_tokens} but the prompt has {prompt_len} tokens "
            f"and the context limit is {limits.max_context} (at most {room} new tokens)",
            req.max_tokens_param,
        )
    if req.params.min_tokens > req.max_tokens:
        raise ProtocolError("'min_tokens' must be <= max_tokens", "min_tokens")
    return req.max_tokens


def _common(body: dict, limits: Limits, logprobs: int | None) -> dict:
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ProtocolError("'stream_options' must be an object", "stream_options")
    check_fields(options or {}, STREAM_OPTIONS_FIELDS, "stream_options")
    structured, structured_param = openai_constraint(body)
    return dict(
        params=sampling_params(body, limits, logprobs, structured),
        max_tokens=get_int(body, name, None, 0, 2**63),
        max_tokens_param=name,
        structured_param=structured_param,
        stream=get_bool(body, "stream", False),
        include_usage=get_bool(options or {}, "include_usage", False),
        model=get_str(body, "model", None),
    )


def require_object(body: object) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


# ---- endpoints -----------------------------------------------------------------------------------
def parse_completion(body: object, limits: Limits) -> CompletionRequest:
    body = require_object(body)
    check_fields(body, COMPLETION_FIELDS)
    check_defaults(body, ROUTER_DEFAULTS)
    best_of = sampling_int(body, "best_of", None, like="n")
    logprobs = sampling_int(body, "logprobs", None)
    req = CompletionRequest(**_common(body, limits, logprobs), prompts=prompts_field(body, limits),
                            echo=get_bool(body, "echo", False),
                            prompt_logprobs=sampling_int(body, "prompt_logprobs", None))
    # echo with logprobs shows the prompt tokens' log-probs too, with `logprobs` alternatives
    wanted = [k for k in (req.prompt_logprobs, logprobs if req.echo else None) if k is not None]
    req.params.prompt_logprobs = max(wanted, default=None)
    if best_of is not None and best_of != req.params.n:
        raise ProtocolError("'best_of' other than n is not supported", "best_of")
    return req


def prompts_field(body: dict, limits: Limits, name: str = "prompt") -> list[Prompt]:
    """A string, a list of token ids, or a list of those (`prompt`; embeddings' `input`)."""
    if name not in body or body[name] is None:
        raise ProtocolError(f"'{name}' is required", name)
    value = body[name]
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ProtocolError(
            f"'{name}' must be a non-empty string, list of token ids, or list of those", name
        )
    if len(value) > MAX_PROMPTS:
        raise ProtocolError(
            f"'{name}' has {len(value)} prompts; at most {MAX_PROMPTS} are allowed", name
        )
    prompts: list[Prompt] = []
    for p in value:
        if isinstance(p, str):
            if not p:
                raise ProtocolError(f"'{name}' must not be empty", name)
            prompts.append(p)
        elif isinstance(p, list) and p:
            prompts.append(token_ids(p, name, limits.vocab_size))
        else:
            raise ProtocolError(
                f"'{name}' must be a non-empty string, list of token ids, or list of those", name
            )
    return prompts


def parse_chat(body: object, limits: Limits) -> ChatRequest:
    body = require_object(body)
    check_fields(body, CHAT_FIELDS)
    check_defaults(body, CHAT_ROUTER_DEFAULTS)
    reasoning = ReasoningOptions(get_bool(body, "separate_reasoning", True),
                                 get_bool(body, "stream_reasoning", True),
                                 get_bool(body, "include_reasoning", True))
    kwargs = body.get("chat_template_kwargs")
    want = get_bool(body, "logprobs", False)
    top = sampling_int(body, "top_logprobs", None, like="logprobs")
    if top is not None and not want:
        raise ProtocolError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    req = ChatRequest(
        **_common(body, limits, (top or 0) if want else None),
        messages=_messages(body),
        logprobs=want,
        tools=parse_tool_request(body),
        prompt_logprobs=sampling_int(body, "prompt_logprobs", None),
        template_kwargs={} if kwargs is None else template_kwargs_of(kwargs),
        thinking_budget=get_int(body, "thinking_token_budget", None, 0, 2**31 - 1),
        reasoning=reasoning,
    )
    if req.prompt_logprobs is not None and req.stream:
        raise ProtocolError("'prompt_logprobs' is not supported with 'stream' on chat "
                            "completions", "prompt_logprobs")
    req.params.prompt_logprobs = req.prompt_logprobs
    forced = req.tools.constraint() if req.tools is not None else None
    if forced is not None:
        if req.params.structured is not None:
            raise ProtocolError(
                "'tool_choice' required or a named function cannot be combined with "
                f"'{req.structured_param}'",
                "tool_choice",
            )
        req.params = dataclasses.replace(req.params, structured=forced)
        req.structured_param = "tools"
    return req


def _messages(body: dict) -> list[dict]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise ProtocolError("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ProtocolError(f"'{where}' must be an object", where)
        check_fields(m, MESSAGE_FIELDS, where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ProtocolError(
                f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}", f"{where}.role"
            )
        message = {"role": role, "content": _content(m.get("content"), f"{where}.content", role)}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise ProtocolError(
                    f"'{where}.tool_calls' belongs to an assistant message", f"{where}.tool_calls"
                )
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ProtocolError(
                    f"'{where}.tool_call_id' is required in a tool message", f"{where}.tool_call_id"
                )
            message["tool_call_id"] = call_id
        if m.get("name") is not None:
            message["name"] = get_str(m, "name", "")
        out.append(message)
    return out


def _tool_calls(value: object, where: str) -> list[dict]:
    """An assistant message's calls as chat templates take them (arguments as an object)."""
    if not isinstance(value, list):
        raise ProtocolError(f"'{where}' must be an array", where)
    calls = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ProtocolError(
                f"'{where}[{i}]' must be a call with a function name", f"{where}[{i}]"
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except json.JSONDecodeError:
                field = f"{where}[{i}].function.arguments"
                raise ProtocolError(f"'{field}' is not JSON", field) from None
        calls.append({"id": call.get("id") or f"call_{i}", "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return calls


def _content(value: object, where: str, role: str) -> str:
    if value is None and role in ("assistant", "tool"):
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ProtocolError(
                    f"'{where}' parts must be {{\"type\": \"text\", \"text\": ...}}", where
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ProtocolError(f"'{where}' must be a string or an array of text parts", where)


def parse_native(body: object, limits: Limits) -> tuple[Prompt, GenerationRequest]:
    """`POST /generate`: {"text" | "input_ids", "sampling_params": {...}, "stream": bool}."""
    body = require_object(body)
    check_fields(body, NATIVE_FIELDS)
    check_defaults(body, NATIVE_ROUTER_DEFAULTS)
    if body.get("text") is not None:
        prompt: Prompt = get_str(body, "text", "")
        if not prompt:
            raise ProtocolError("'text' must not be empty", "text")
    elif body.get("input_ids") is not None:
        prompt = token_ids(body["input_ids"], "input_ids", limits.vocab_size)
        if not prompt:
            raise ProtocolError("'input_ids' must not be empty", "input_ids")
    else:
        raise ProtocolError("one of 'text' or 'input_ids' is required", "text")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise ProtocolError("'sampling_params' must be an object", "sampling_params")
    check_fields(sp, NATIVE_SAMPLING_FIELDS, "sampling_params")
    logprobs = sampling_int(sp, "logprobs", None)
    if get_bool(body, "return_text_in_logprobs", False) and logprobs is not None:
        raise ProtocolError("'return_text_in_logprobs' is not supported with logprobs: the "
                            "log-probs carry token ids only", "return_text_in_logprobs")
    name = "max_new_tokens" if sp.get("max_new_tokens") is not None else "max_tokens"
    structured, structured_param = native_constraint(sp)
    params = sampling_params(sp, limits, logprobs, structured)
    params.prompt_logprobs = sampling_int(sp, "prompt_logprobs", None)
    if sp.get("priority") is not None:
        raise ProtocolError("/generate takes 'priority' at the top level, with SGLang's meaning "
                            "(higher is sooner)", "sampling_params.priority")
    # SGLang's field and meaning (its default: larger values first), as the ledger's (lower first)
    params.priority = -get_int(body, "priority", 0, -(2**31) + 1, 2**31 - 1)
    req = GenerationRequest(
        params=params,
        max_tokens=get_int(sp, name, None, 0, 2**63),
        max_tokens_param=name,
        structured_param=structured_param,
        stream=get_bool(body, "stream", False),
        model=get_str(body, "model", None),
        lora_path=get_str(body, "lora_path", None),
    )
    return prompt, req
