"""A tiny OpenAI-compatible SSE server on 127.0.0.1 for the `bench serve` tests: streams one chunk
per token (`max_tokens` of them), then usage, then [DONE]; prompts starting with token 0 get a
400."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

REJECTED_FIRST_ID = 0  # random datasets never use it


def make_app(seen: list[dict]) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse("# TYPE compiled_engine_prefix_cache_hit_rate gauge\n"
                                 "compiled_engine_prefix_cache_hit_rate 0.25\n")

    async def completions(request: Request):
        body = await request.json()
        seen.append({**body, "t_start": time.monotonic()})
        if body["prompt"][0] == REJECTED_FIRST_ID:
            return JSONResponse(
                {"error": {"message": "nope", "type": "invalid_request_error"}}, status_code=400
            )
        n = body["max_tokens"]

        async def stream():
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {
                    "object": "text_completion",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "text": f"t{i} ",
                            "finish_reason": "length" if i == n - 1 else None,
                        }
                    ],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": n,
                "total_tokens": n,
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                             Route("/v1/completions", completions, methods=["POST"])])


@contextmanager
def fake_server() -> Iterator[tuple[str, list[dict]]]:
    """(base URL on a free loopback port, the request bodies received)."""
    seen: list[dict] = []
    server = uvicorn.Server(
        uvicorn.Config(make_app(seen), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)
