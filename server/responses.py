"""`POST /v1/responses`: OpenAI's Responses API over the chat path.

A request becomes a chat request (`instructions` a system message first; a string `input` one user
message; input items: messages, `function_call` and `function_call_output`; `text.format` the
response format; function tools and `tool_choice` in the chat shape), parsed and run as a chat
completion is, and its answer becomes output items: one `message` with its `output_text`, or one
`function_call` per call. `previous_response_id` continues a stored response: the conversation that
led to it and its output come first. Responses are kept in memory (`response_store.py`: the latest
`capacity`, unless `store` is false), each for the API key that made it alone."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from server.generation import Delta, Generation
from server.handlers import (
    chat_prompt,
    choice_calls,
    collect,
    endpoint,
    json_response,
    list_page,
    model_name,
    new_generation,
    only_queries,
    read_json,
    state_of,
    stream,
)
from server.openai_format import sse
from server.owners import request_owner
from server.protocol import (
    ChatRequest,
    ProtocolError,
    check_defaults,
    check_fields,
    get_bool,
    get_str,
    parse_chat,
    require_object,
)
from server.response_store import Stored
from server.thinking import Thinking

IDS = ("user", "safety_identifier", "prompt_cache_key")  # ids that ask for no behaviour
# accepted with the value that asks for nothing more than the server does anyway
DEFAULTS = {"include": [], "truncation": "disabled", "background": False, "service_tier": "auto"}
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                    "stream", "text", "tools", "tool_choice", "parallel_tool_calls",
                    "previous_response_id", "store", "metadata", "priority", "cache_salt", *IDS,
                    *DEFAULTS})
TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})
ITEM_FIELDS = {
    "message": frozenset({"type", "role", "content", "id", "status"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
    # a reasoning item a previous response returned: taken, and left out of the prompt (chat
    # templates drop the history's thinking, as Qwen3's and DeepSeek-R1's do)
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}
# a chat field's name in an error -> the Responses field it came from (prefixes, in order)
FIELD_NAMES = (("messages", "input"), ("max_tokens", "max_output_tokens"),
               ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
        and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ProtocolError(f"'{where}.content' must be a string or a list of input_text parts", where)


def _input_messages(value: object) -> list[dict]:
    """`input` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ProtocolError("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind not in ITEM_FIELDS:
            raise ProtocolError(f"'{where}.type' {kind!r} is not supported (message, "
                                "function_call, function_call_output, reasoning)",
                                f"{where}.type")
        check_fields(item, ITEM_FIELDS[kind], where)
        if kind == "reasoning":
            continue
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content_text(item.get("content"),
                                                                           where)})
            continue
        for name in ("call_id", *(("name", "arguments") if kind == "function_call"
                                  else ("output",))):
            if not isinstance(item.get(name), str):
                raise ProtocolError(f"'{where}.{name}' must be a string", f"{where}.{name}")
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
    return out


def _check_plain_fields(body: dict) -> None:
    """The fields taken as given: ids, `metadata`, and defaults that ask for nothing."""
    for name in IDS:
        get_str(body, name, None)
    check_defaults(body, DEFAULTS)
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and len(metadata) <= 16
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise ProtocolError("'metadata' must be at most 16 string keys and values", "metadata")


def _chat_body(body: dict, conversation: list[dict]) -> dict:
    """The chat request a Responses request is: its `instructions` (not kept for a follow-up, as
    OpenAI's) first, then the conversation."""
    messages = list(conversation)
    if body.get("instructions") is not None:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat: dict = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("user", "user"), ("priority", "priority"),
                         ("cache_salt", "cache_salt"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    text = body.get("text")
    if text is not None:
        check_fields(require_object(text), frozenset({"format"}), "text")
        fmt = text.get("format")
        if fmt is not None:
            fmt = require_object(fmt)
            if fmt.get("type") == "json_schema":
                check_fields(fmt, frozenset({"type", "name", "schema", "strict", "description"}),
                             "text.format")
                chat["response_format"] = {"type": "json_schema", "json_schema": {
                    k: v for k, v in fmt.items() if k != "type"}}
            else:
                chat["response_format"] = fmt
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list of function tools", "tools")
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ProtocolError(f"'tools[{i}]' must be a function tool (the only kind served)",
                                f"tools[{i}]")
        check_fields(t, TOOL_FIELDS, f"tools[{i}]")
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items()
                                                           if k != "type"}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


@dataclass
class _Answer:
    """One finished choice: its status, its output items, and the assistant message a follow-up
    sees."""

    status: str  # completed | incomplete (max_output_tokens) | failed
    items: list[dict]
    message: dict
    error: str | None = None
    reasoning_tokens: int = 0


def _answer(st, req: ChatRequest, gen: Generation, thinking: Thinking) -> _Answer:
    c = gen.choices[0]
    status = {"length": "incomplete", "error": "failed"}.get(c.finish_reason, "completed")
    text, calls = choice_calls(st, req.tools, c, thinking.answer)
    reasoning = thinking.reasoning(c.detok.text)
    items: list[dict] = []
    if reasoning is not None:  # the thinking span, as OpenAI's reasoning models return it
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}]})
    if text or not calls:  # text the model wrote before its calls stays, as OpenAI's does
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": text or "", "annotations": []}]})
    openai_calls = [t.as_openai() for t in calls]
    items += [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": t["id"],
               "name": t["function"]["name"], "arguments": t["function"]["arguments"],
               "status": "completed"} for t in openai_calls]
    message = {"role": "assistant", "content": text or ("" if not calls else None)}
    if openai_calls:
        message["tool_calls"] = openai_calls
    return _Answer(status, items, message, c.error if status == "failed" else None,
                   thinking.reasoning_tokens(c.detok.text, c.token_ids))


def _response(st, body: dict, req: ChatRequest, rid: str, created: float, status: str,
              output: list[dict], gen: Generation | None, answer: _Answer | None = None,
              error: str | None = None) -> dict:
    error = answer.error if answer is not None else error
    incomplete = status == "incomplete"
    out = {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "model": model_name(st, req), "output": output,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "previous_response_id": body.get("previous_response_id"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata"), "store": body.get("store", True),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": {"code": "server_error", "message": error} if status == "failed" else None,
    }
    if gen is not None:
        out["usage"] = {
            "input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens_details": {
                "reasoning_tokens": answer.reasoning_tokens if answer is not None else 0},
        }
    return out


def _renamed(e: ProtocolError) -> ProtocolError:
    """A chat request's error, named by the Responses fields it came from."""
    param = e.param or ""
    for theirs, ours in FIELD_NAMES:
        if param.startswith(theirs):
            e.message = e.message.replace(f"'{theirs}", f"'{ours}")
            e.param = ours if theirs == "messages" else ours + param[len(theirs):]
            break
    return e


@endpoint("responses")
async def responses(request: Request) -> Response:
    st = state_of(request)
    body = require_object(await read_json(request))
    check_fields(body, FIELDS)
    _check_plain_fields(body)
    want_stream, keep = get_bool(body, "stream", False), get_bool(body, "store", True)
    previous, owner = body.get("previous_response_id"), request_owner(request)
    conversation = [*(st.responses.get(previous, owner).messages if previous is not None else []),
                    *_input_messages(body.get("input"))]
    input_items = _input_items(body["input"])
    chat = _chat_body(body, conversation)
    try:
        req = parse_chat(chat, st.limits)
        prompt = await chat_prompt(st, req.messages, req.tools, req.template_kwargs)
        thinking = await Thinking.of(st, req)
        gen = new_generation(st, "resp", req, [prompt], None)
    except ProtocolError as e:
        raise _renamed(e) from None
    rid, created = f"resp_{uuid.uuid4().hex}", time.time()

    def finish(answer: _Answer, response: dict) -> None:
        if keep:
            st.responses.put(rid, Stored([*conversation, answer.message], response, input_items,
                                         owner))

    if not want_stream:
        await collect(request, st, gen)
        a = _answer(st, req, gen, thinking)
        out = _response(st, body, req, rid, created, a.status, a.items, gen, a)
        finish(a, out)
        return json_response(out)
    return await _stream(st, body, req, gen, rid, created, finish, thinking)


def _input_items(value: object) -> list[dict]:
    """`input` (checked by `_input_messages`) as the input items a retrieve lists, with ids."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for item in value:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}
        items.append({"id": f"{prefix[item['type']]}_{uuid.uuid4().hex}", **item})
    return items


@endpoint("responses")
async def retrieve_response(request: Request) -> Response:
    """OpenAI's `GET /v1/responses/{id}`: the stored response as it was answered (no query
    parameter: a stream of its events again is not served)."""
    st = state_of(request)
    if request.query_params:
        name = sorted(request.query_params)[0]
        raise ProtocolError(f"query parameter {name!r} is not supported", name)
    return json_response(st.responses.get(request.path_params["response_id"],
                                          request_owner(request), None).response)


@endpoint("responses")
async def delete_response(request: Request) -> Response:
    st = state_of(request)
    rid = request.path_params["response_id"]
    st.responses.get(rid, request_owner(request), None)  # 404 when absent (or another's)
    st.responses.delete(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


@endpoint("responses")
async def cancel_response(request: Request) -> Response:
    """Only a background response can be cancelled; this server runs none in the background (a
    request's `background: true` is refused), so a stored response is answered as OpenAI answers
    a finished one."""
    st = state_of(request)
    st.responses.get(request.path_params["response_id"], request_owner(request), None)
    raise ProtocolError("Cannot cancel a synchronous response.", None, 400)


@endpoint("responses")
async def response_input_items(request: Request) -> Response:
    """OpenAI's `GET /v1/responses/{id}/input_items`: the request's input items, newest first
    (`order=asc` oldest first), `limit` (1..100, default 20) after the id `after`."""
    st = state_of(request)
    items = list(st.responses.get(request.path_params["response_id"], request_owner(request),
                                  None).input_items)
    only_queries(request.query_params, {"order", "limit", "after"})
    return json_response(list_page(items[::-1], request.query_params))


async def _stream(st, body, req, gen, rid, created, finish, thinking: Thinking) -> Response:
    """The Responses event stream: created, in_progress; for a plain answer the message's item and
    part, a text delta per engine delta, their done events; with tools on or a reasoning parser,
    the items once the answer is whole (a call, or where the thinking ends, is known only then);
    completed (or incomplete, or failed); an engine error mid-stream: `error` and
    `response.failed`."""
    seq = iter(range(1 << 62))
    calling = (req.tools is not None and req.tools.choice != "none") or thinking.parser is not None
    msg_id = f"msg_{uuid.uuid4().hex}"

    def event(kind: str, **fields: object) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    def snapshot(status: str, output: list[dict], answer: _Answer | None = None) -> dict:
        return _response(st, body, req, rid, created, status, output,
                         gen if answer is not None else None, answer)

    empty_part = {"type": "output_text", "text": "", "annotations": []}
    head = [sse(event("response.created", response=snapshot("in_progress", []))),
            sse(event("response.in_progress", response=snapshot("in_progress", [])))]
    if not calling:
        head += [
            sse(event("response.output_item.added", output_index=0, item={
                "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                "content": []})),
            sse(event("response.content_part.added", item_id=msg_id, output_index=0,
                      content_index=0, part=empty_part)),
        ]

    def chunk(d: Delta) -> dict | None:
        if calling or not d.text:
            return None
        return event("response.output_text.delta", item_id=msg_id, output_index=0,
                     content_index=0, delta=d.text, logprobs=[])

    def tail() -> list[str]:
        answer = _answer(st, req, gen, thinking)
        events: list[dict] = []
        for i, item in enumerate(answer.items):
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                events += [
                    event("response.output_item.added", output_index=i,
                          item=item | {"content": []}),
                    event("response.reasoning_text.delta", item_id=item["id"], output_index=i,
                          content_index=0, delta=text),
                    event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                          content_index=0, text=text),
                ]
            elif item["type"] == "message":
                item["id"] = msg_id if not calling else item["id"]
                part = item["content"][0]
                if calling:
                    events += [
                        event("response.output_item.added", output_index=i,
                              item=item | {"status": "in_progress", "content": []}),
                        event("response.content_part.added", item_id=item["id"], output_index=i,
                              content_index=0, part=empty_part),
                        event("response.output_text.delta", item_id=item["id"], output_index=i,
                              content_index=0, delta=part["text"], logprobs=[]),
                    ]
                events += [
                    event("response.output_text.done", item_id=item["id"], output_index=i,
                          content_index=0, text=part["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=i,
                          content_index=0, part=part),
                ]
            else:
                events += [
                    event("response.output_item.added", output_index=i,
                          item=item | {"status": "in_progress", "arguments": ""}),
                    event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=i, delta=item["arguments"]),
                    event("response.function_call_arguments.done", item_id=item["id"],
                          output_index=i, arguments=item["arguments"]),
                ]
            events.append(event("response.output_item.done", output_index=i, item=item))
        done = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            answer.status, "response.completed")
        final = snapshot(answer.status, answer.items, answer)
        finish(answer, final)
        events.append(event(done, response=final))
        return [sse(e) for e in events]

    def failed(message: str) -> list[str]:
        """An error mid-stream, as OpenAI's Responses stream reports one."""
        return [sse(event("error", code="server_error", message=message, param=None)),
                sse(event("response.failed", response=_response(
                    st, body, req, rid, created, "failed", [], None, error=message)))]

    return await stream(st, gen, head, chunk, tail, failed)
