"""The endpoints: OpenAI-compatible, native, health, metrics, debug."""

from __future__ import annotations

import contextlib
import time

from starlette.requests import Request
from starlette.responses import Response

from compiled_engine.models.demo import DEMO_LABEL
from server.engine_client import EngineDead
from server.generation import Delta
from server.handlers import (
    chat_prompt,
    check_model,
    choice_calls,
    collect,
    endpoint,
    json_response,
    model_name,
    new_generation,
    off_loop,
    read_json,
    state_of,
    stream,
    tokenize_prompts,
    usage_tail,
    whole,
)
from server.openai_format import (
    CompletionLogprobs,
    TokenText,
    chat_logprobs,
    native_prompt_logprobs,
    prompt_logprobs,
    sse,
    usage,
)
from server.protocol import (
    CHAT_ROUTER_DEFAULTS,
    ChatRequest,
    ProtocolError,
    check_defaults,
    check_fields,
    get_bool,
    get_str,
    parse_chat,
    parse_completion,
    parse_native,
    require_object,
    token_ids,
)
from server.thinking import REASONING_KEYS, Thinking

TOKENIZE_FIELDS = frozenset({"model", "prompt", "text", "messages", "add_special_tokens",
                             "continue_final_message"})
# OpenAI's default for /v1/completions; chat defaults to the rest of the context
COMPLETION_DEFAULT_MAX_TOKENS = 16
# /health and /server_info reuse engine stats this recent: their polls cost the engine one round
# trip a second whatever their number (a /metrics scrape reads them fresh)
STATS_MAX_AGE_S = 1.0


async def health(request: Request) -> Response:
    st = state_of(request)
    if not st.client.alive:
        return json_response({"status": "dead", "reason": st.client.dead_reason}, 503)
    if st.client.draining:
        return json_response({"status": "draining", "reason": "the server is shutting down"}, 503)
    try:
        await st.client.recent_stats(STATS_MAX_AGE_S, st.config.health_timeout_s)
    except (TimeoutError, EngineDead) as e:
        return json_response(
            {"status": "unavailable", "reason": str(e) or "the engine did not answer in time"}, 503
        )
    return json_response({"status": "ok"})


async def metrics(request: Request) -> Response:
    st = state_of(request)
    with contextlib.suppress(TimeoutError, EngineDead):
        st.metrics.set_engine_stats(
            (await st.client.stats(st.config.health_timeout_s)).stats, st.client.num_in_flight
        )
    return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@endpoint("integrity")
async def integrity(request: Request) -> Response:
    st = state_of(request)
    reply = await st.client.stats(st.config.health_timeout_s, check_integrity=True)
    return json_response(reply.stats | {"integrity_error": reply.integrity_error,
                                        "server_in_flight": st.client.num_in_flight})


async def models(request: Request) -> Response:
    st = state_of(request)
    card = {
        "id": st.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "compiled-engine",
        "max_model_len": st.limits.max_context,
        "root": st.model_name,
        "parent": None,
    }
    # LoRA adapters as vLLM lists them: their path as root, the base model as parent
    adapters = [card | {"id": name, "root": path, "parent": st.model_name}
                for name, path in st.adapters.items()]
    if st.is_demo:
        card["description"] = DEMO_LABEL
    return json_response({"object": "list", "data": [card, *adapters]})


@endpoint("completions")
async def completions(request: Request) -> Response:
    st = state_of(request)
    req = parse_completion(await read_json(request), st.limits)
    prompts = await tokenize_prompts(st, req.prompts)
    gen = new_generation(st, "cmpl", req, prompts, COMPLETION_DEFAULT_MAX_TOKENS)
    n = req.params.n
    echo = await off_loop(lambda: [
        (p if isinstance(p, str) else st.tokenizer.decode(ids)) if req.echo else ""
        for p, ids in zip(req.prompts, prompts, strict=True)
    ])
    want_logprobs = req.params.logprobs is not None
    token_text = TokenText(st.tokenizer)
    lp = [CompletionLogprobs(token_text) for _ in gen.choices]
    base = {"id": gen.request_id, "object": "text_completion", "created": int(time.time()),
            "model": model_name(st, req)}

    def choice(d: Delta, text: str, first: bool) -> dict:
        prompt_ids = gen.choices[d.index].prompt_ids
        echo_ids = prompt_ids if first and req.echo else None
        logprobs = (
            lp[d.index].build(d, echo_ids, req.params.logprobs) if want_logprobs else None
        )
        out = {"index": d.index, "text": text, "logprobs": logprobs,
               "finish_reason": d.finish_reason}
        if req.prompt_logprobs is not None and first:
            out["prompt_logprobs"] = prompt_logprobs(
                prompt_ids, d.prompt_logprobs, req.prompt_logprobs, token_text
            )
        return out

    if not req.stream:
        await collect(request, st, gen)
        choices = [choice(whole(c), echo[c.index // n] + c.detok.text, True) for c in gen.choices]
        return json_response(base | {"choices": choices, "usage": usage(gen)})

    started: set[int] = set()

    def chunk(d: Delta) -> dict:
        first = d.index not in started
        started.add(d.index)
        text = (echo[d.index // n] if first else "") + d.text
        return base | {"choices": [choice(d, text, first)]}

    return await stream(st, gen, [], chunk, usage_tail(req, gen, base))


@endpoint("chat")
async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    req: ChatRequest = parse_chat(await read_json(request), st.limits)
    prompt = await chat_prompt(st, req.messages, req.tools, req.template_kwargs)
    thinking = await Thinking.of(st, req)
    gen = new_generation(st, "chatcmpl", req, [prompt], None)
    token_text = TokenText(st.tokenizer)
    base = {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model_name(st, req)}
    calling = req.tools is not None and req.tools.choice != "none"

    def message(c) -> tuple[dict, str | None]:
        """The choice's assistant message and finish reason: its thinking apart (with a reasoning
        parser), tool calls parsed out of its answer when tools are on."""
        content, calls = choice_calls(st, req.tools, c, thinking.answer)
        msg = {"role": "assistant", "content": content} | thinking.fields(c.detok.text)
        if not calls:
            return msg, c.finish_reason
        return msg | {"tool_calls": [t.as_openai() for t in calls]}, "tool_calls"

    if not req.stream:
        await collect(request, st, gen)
        choices = []
        for c in gen.choices:
            msg, reason = message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "finish_reason": reason,
                    "logprobs": chat_logprobs(whole(c), token_text) if req.logprobs else None,
                }
            )
        extra = {}
        if req.prompt_logprobs is not None:  # vLLM's place: the response, for the one prompt
            first = gen.choices[0]
            extra["prompt_logprobs"] = prompt_logprobs(first.prompt_ids, first.prompt_logprobs,
                                                       req.prompt_logprobs, token_text)
        return json_response(
            base | {"choices": choices, "usage": usage(gen, thinking.usage_tokens(gen.choices))}
            | extra)

    base["object"] = "chat.completion.chunk"
    head = [
        sse(
            base
            | {
                "choices": [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            }
        )
        for c in gen.choices
    ]

    def chunk(d: Delta) -> dict | None:
        if calling:  # a call is known only once the output is whole: its choice is sent at its end
            return tool_chunk(d) if d.finish_reason is not None else None
        if thinking.parser is not None:
            delta = thinking.stream_delta(d)
        else:
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        return base | {
            "choices": [
                {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": chat_logprobs(d, token_text) if req.logprobs else None,
                    "finish_reason": d.finish_reason,
                }
            ]
        }

    def tool_chunk(d: Delta) -> dict:
        """One chunk holding the whole choice: its content, or its calls as OpenAI streams them (by
        index: id, type and name, then the arguments), its logprobs (every token's, when asked) and
        the finish reason."""
        msg, reason = message(gen.choices[d.index])
        delta: dict = {"content": msg["content"]} if msg["content"] else {}
        delta |= {k: msg[k] for k in REASONING_KEYS if msg.get(k)}
        if "tool_calls" in msg:
            delta["tool_calls"] = [{"index": i} | t for i, t in enumerate(msg["tool_calls"])]
        logprobs = chat_logprobs(whole(gen.choices[d.index]), token_text) if req.logprobs else None
        return base | {
            "choices": [
                {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            ]
        }

    return await stream(st, gen, head, chunk,
                        usage_tail(req, gen, base, lambda: thinking.usage_tokens(gen.choices)))


@endpoint("generate")
async def generate(request: Request) -> Response:
    """Native: {"text" | "input_ids", "sampling_params": {...}, "stream": bool} -> token ids and
    text."""
    st = state_of(request)
    prompt, req = parse_native(await read_json(request), st.limits)
    gen = new_generation(
        st, "gen", req, await tokenize_prompts(st, [prompt]), COMPLETION_DEFAULT_MAX_TOKENS
    )

    def out(d: Delta) -> dict:
        return {
            "index": d.index,
            "text": d.text,
            "output_ids": d.token_ids,
            "finish_reason": d.finish_reason,
            "output_logprobs": d.logprobs if req.params.logprobs is not None else None,
        } | ({"prompt_logprobs": native_prompt_logprobs(d.prompt_logprobs)}
             if d.prompt_logprobs is not None else {})

    if not req.stream:
        await collect(request, st, gen)
        outs = [out(whole(c)) | {"prompt_tokens": gen.prompt_lens[0],
                                 "cached_tokens": c.cached_tokens} for c in gen.choices]
        return json_response(outs[0] if len(outs) == 1 else outs)
    return await stream(st, gen, [], out)


@endpoint("tokenize")
async def tokenize(request: Request) -> Response:
    st = state_of(request)
    body = require_object(await read_json(request))
    check_fields(body, TOKENIZE_FIELDS)
    check_defaults(body, CHAT_ROUTER_DEFAULTS)
    check_model(st, get_str(body, "model", None))
    if body.get("messages") is not None:
        # the chat template places the special tokens
        if body.get("add_special_tokens") is not None:
            raise ProtocolError(
                "'add_special_tokens' applies to 'prompt' / 'text', not to 'messages'",
                "add_special_tokens",
            )
        try:
            messages = parse_chat({"messages": body["messages"]}, st.limits).messages
        except ValueError as e:
            raise ProtocolError(str(e), "messages") from None
        ids = await chat_prompt(st, messages, None, {})
    else:
        text = (
            get_str(body, "prompt", None)
            if body.get("prompt") is not None
            else get_str(body, "text", None)
        )
        if text is None:
            raise ProtocolError("one of 'prompt', 'text' or 'messages' is required", "prompt")
        special = get_bool(body, "add_special_tokens", True)
        ids = await off_loop(lambda: st.tokenizer(text, add_special_tokens=special).input_ids)
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": st.limits.max_context})


@endpoint("detokenize")
async def detokenize(request: Request) -> Response:
    st = state_of(request)
    body = require_object(await read_json(request))
    check_fields(body, frozenset({"model", "tokens"}))
    check_model(st, get_str(body, "model", None))
    ids = token_ids(body.get("tokens"), "tokens", st.limits.vocab_size)
    return json_response({"text": await off_loop(lambda: st.tokenizer.decode(ids))})
