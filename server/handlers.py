"""Shared request plumbing: body reading, error mapping, and running a generation plain or as
SSE."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
from jinja2 import TemplateError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from compiled_engine.tokenization import encode_chat
from server.engine_client import EngineDead, EngineRejected, Overloaded
from server.generation import Choice, Delta, Generation, expand_choices, run
from server.openai_format import dumps, sse, usage
from server.protocol import GenerationRequest, ProtocolError, check_text, resolve_max_tokens
from server.sse import ClientGone, EventStream, unless_disconnected
from server.state import ServerState
from server.tools import ToolCall, ToolRequest, extract_calls

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_S = "1"  # a 429's Retry-After: the queue moves at the speed of a few steps


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def error_response(e: ProtocolError) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def read_json(request: Request) -> object:
    """The body as JSON: 415 unless it says it is JSON, 413 past the size limit, 408 past the read
    timeout, 400 unless it parses."""
    given = request.headers.get("content-type", "")
    if not is_json(given):
        raise ProtocolError(f"request bodies must be JSON: send 'Content-Type: application/json' "
                            f"(got '{given[:64] or 'none'}')", status=415,
                            code="unsupported_media_type")
    limit = state_of(request).config.max_body_bytes
    too_big = ProtocolError(f"the request body is larger than {limit} bytes", status=413)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    timeout = state_of(request).config.read_timeout_s
    try:
        with anyio.fail_after(timeout):  # a slow upload (slowloris) is cut
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
    except TimeoutError:
        raise ProtocolError(f"the request body did not arrive within {timeout:g} s", status=408,
                            code="request_timeout") from None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"the request body is not valid JSON: {str(e)[:200]}") from None
    check_text(parsed)
    return parsed


def endpoint(name: str) -> Callable:
    """Map failures to OpenAI-shaped errors and count requests by status."""

    def wrap(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ProtocolError as e:
                response = error_response(e)
            except EngineRejected as e:
                response = error_response(ProtocolError(str(e)))
            except Overloaded as e:
                response = error_response(ProtocolError(str(e), status=429, kind="rate_limit_error",
                                                        code="overloaded"))
                response.headers["Retry-After"] = RETRY_AFTER_S
            except EngineDead as e:
                response = error_response(
                    ProtocolError(
                        f"the engine is unavailable: {e}", status=503, kind="server_error"
                    )
                )
            except (ClientGone, ClientDisconnect):
                response = Response(status_code=499)
            except Exception:
                log.exception("%s failed", name)
                response = error_response(
                    ProtocolError("internal server error", status=500, kind="server_error")
                )
            state_of(request).metrics.requests.labels(name, str(response.status_code)).inc()
            return response

        return wrapped

    return wrap


def tokenize_prompt(st: ServerState, prompt: str | list[int]) -> list[int]:
    return st.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)


async def off_loop(work: Callable[[], T]) -> T:
    """Run tokenizer and chat-template work in a worker thread: a large input never holds the event
    loop (the tokenizer's Rust code releases the GIL)."""
    return await asyncio.to_thread(work)


async def tokenize_prompts(st: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    return await off_loop(lambda: [tokenize_prompt(st, p) for p in prompts])


def check_model(st: ServerState, model: str | None) -> None:
    """404 in OpenAI's shape for a model this server does not serve (absent: the served one); a
    LoRA adapter's name is one (`ServerState.adapter_of`)."""
    st.adapter_of(model)


def new_generation(st: ServerState, prefix: str, req: GenerationRequest, prompts: list[list[int]],
                default_max_tokens: int | None) -> Generation:
    lora = st.adapter_of(req.model)
    if req.lora_path is not None:
        if lora is not None:
            raise ProtocolError("give the adapter in `model` or in `lora_path`, not both",
                                "lora_path")
        lora = next((n for n, p in st.adapters.items() if req.lora_path in (n, p)), None)
        if lora is None:
            raise ProtocolError(f"no LoRA adapter named '{req.lora_path[:100]}' is loaded",
                                "lora_path", status=404)
    params = [
        dataclasses.replace(
            req.params, max_tokens=resolve_max_tokens(req, len(ids), st.limits, default_max_tokens)
        )
        for ids in prompts
    ]
    gen = expand_choices(
        f"{prefix}-{uuid.uuid4().hex}", st.tokenizer, prompts, params, req.structured_param, lora
    )
    st.metrics.prompt_tokens.inc(gen.prompt_tokens)
    return gen


async def collect(request: Request, st: ServerState, gen: Generation) -> None:
    async def drain() -> None:
        async with contextlib.aclosing(
                run(st.client, gen, st.metrics, st.config.request_timeout_s,
                    st.grammars)) as deltas:
            async for _ in deltas:
                pass

    await unless_disconnected(request, drain)


async def stream(
    st: ServerState,
    gen: Generation,
    head: list[str],
    chunk: Callable[[Delta], dict | None],
    tail: Callable[[], list[str]] | None = None,
    failed: Callable[[str], list[str]] | None = None,
) -> EventStream:
    """SSE of `head`, one chunk per delta, `tail()`, [DONE]. The first delta is awaited before the
    response starts, so a request the engine refuses (or overload) still gets a proper status
    code. An error after that: `failed(message)`'s events (default: one `{"error": ...}` event),
    then [DONE]."""
    deltas = run(st.client, gen, st.metrics, st.config.request_timeout_s, st.grammars)
    try:
        first = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            for h in head:
                yield h
            obj = chunk(first)
            if obj is not None:
                yield sse(obj)
            async for d in deltas:
                obj = chunk(d)
                if obj is not None:
                    yield sse(obj)
            for t in tail() if tail is not None else []:
                yield t
        except (EngineDead, EngineRejected, ProtocolError) as e:
            # a client's error (a request timeout) keeps its type; the engine's are the server's
            error = (e if isinstance(e, ProtocolError)
                     else ProtocolError(str(e), kind="server_error"))
            for event in failed(str(e)) if failed is not None else [sse(error.body())]:
                yield event
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    return EventStream(body())


def model_name(st: ServerState, req: GenerationRequest) -> str:
    return req.model or st.model_name


def usage_tail(
    req: GenerationRequest, gen: Generation, base: dict,
    reasoning_tokens: Callable[[], int | None] = lambda: None,
) -> Callable[[], list[str]] | None:
    """The stream's usage chunk (when the request asks for it); `reasoning_tokens`: counts the
    thinking once the stream is over (`usage`)."""
    if not req.include_usage:
        return None
    return lambda: [sse(base | {"choices": [], "usage": usage(gen, reasoning_tokens())})]


def whole(c: Choice) -> Delta:
    return Delta(c.index, c.detok.text, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason,
                 c.prompt_logprobs)


def template_args(st: ServerState, tools: ToolRequest | None,
                  template_kwargs: dict) -> tuple[list[dict] | None, dict]:
    """What a chat template renders with beside the messages: the tools' functions, and its
    variables (the server's defaults under the request's)."""
    funcs = tools.template_tools() if tools is not None else None
    return funcs, st.config.default_chat_template_kwargs | template_kwargs


async def chat_prompt(st: ServerState, messages: list[dict], tools: ToolRequest | None,
                      template_kwargs: dict) -> list[int]:
    """The chat template's prompt ids (off the event loop), the server's default template
    variables under the request's; a conversation or a variable the template refuses is a 400."""
    funcs, kwargs = template_args(st, tools, template_kwargs)
    try:
        return await off_loop(lambda: encode_chat(st.tokenizer, messages, tools=funcs,
                                                  template_kwargs=kwargs))
    except (ValueError, TemplateError) as e:  # the template refused the conversation
        raise ProtocolError(str(e)[:500], "messages") from None
    except TypeError as e:  # a variable apply_chat_template takes for an argument of its own
        raise ProtocolError(str(e)[:500], "chat_template_kwargs") from None


def list_page(objs: list[dict], query: Mapping[str, str]) -> dict:
    """OpenAI's list page of `objs` (newest first): `order=asc` oldest first, `limit` (1..100,
    default 20) after the id `after`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ProtocolError("'order' must be 'asc' or 'desc'", "order")
    if order == "asc":
        objs = objs[::-1]
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = -1
    if not 1 <= limit <= 100:
        raise ProtocolError("'limit' must be an integer in [1, 100]", "limit")
    after = query.get("after")
    if after is not None:
        ids = [o["id"] for o in objs]
        if after not in ids:
            raise ProtocolError(f"no item {after[:64]!r} to list after", "after")
        objs = objs[ids.index(after) + 1:]
    page = objs[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(objs) > limit}


def only_queries(query: Mapping[str, str], allowed: set[str]) -> None:
    """400 naming the first query parameter not in `allowed`."""
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise ProtocolError(f"query parameter {unknown[0][:64]!r} is not supported", unknown[0])


def choice_calls(
    st: ServerState, tools: ToolRequest | None, c: Choice,
    answer: Callable[[str], str | None] = lambda text: text,
) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's content and tool calls (none while tools are off), both from its answer
    (`answer`: the text past a thinking span); parsers other than hermes read the special tokens
    too."""
    if tools is None or tools.choice == "none":
        return answer(c.detok.text), []
    raw = (st.tokenizer.decode(c.token_ids, skip_special_tokens=False)
           if st.tool_parser != "hermes" else c.detok.text)
    content = answer(raw)
    return (None, []) if content is None else extract_calls(tools, content, st.tool_parser)
