"""The Starlette app: OpenAI-compatible and native endpoints over one engine (launched in the
lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from compiled_engine.models.demo import DEMO_LABEL, DEMO_NAME
from compiled_engine.models.names import resolve_model
from compiled_engine.ranks.launcher import EngineHandle, StartupRefusal, launch
from compiled_engine.tokenization import load_tokenizer
from server import batch_routes, embeddings, info_routes, lora_routes, responses, routes
from server.batch.runner import Batches, BatchRunner, in_process, running
from server.batch.store import BatchStore, state_root
from server.engine_client import EngineClient
from server.grammar_check import GrammarChecker
from server.handlers import error_response
from server.metrics import Metrics
from server.origin_guard import OriginGuardMiddleware
from server.protocol import Limits, ProtocolError
from server.reasoning import ReasoningParser, reasoning_parser
from server.send_timeout import SendTimeoutMiddleware
from server.state import ServerConfig, ServerState

log = logging.getLogger(__name__)

# The chat page (GET /) and its script and style sheet (GET /static/...): no build step.
STATIC_DIR = Path(__file__).parent / "static"


def _start_engine(
    config: ServerConfig,
) -> tuple[object, Limits, EngineHandle, ReasoningParser | None]:
    """The ranks first: they write what this process then reads (the demo checkpoint, a GGUF file's
    converted tokenizer), so that it needs no torch."""
    if config.engine.model == DEMO_NAME:
        log.warning("model: %s", DEMO_LABEL)
    handle = launch(config.engine, torchrun=config.torchrun)
    try:
        tokenizer = load_tokenizer(resolve_model(config.engine.model))
        reasoning = (None if config.reasoning_parser is None
                     else reasoning_parser(config.reasoning_parser, tokenizer))
    except BaseException as e:
        handle.shutdown()
        if isinstance(e, ValueError):  # a flag the model does not fit (--reasoning-parser)
            raise StartupRefusal(str(e)) from e
        raise
    return (
        tokenizer,
        Limits(handle.ready.max_context, handle.ready.vocab_size or len(tokenizer)),
        handle,
        reasoning,
    )


# the endpoints a batch's lines may name, and their handlers
BATCH_HANDLERS = {"/v1/chat/completions": routes.chat_completions,
                  "/v1/completions": routes.completions, "/v1/embeddings": embeddings.embeddings,
                  "/v1/responses": responses.responses}


def batch_store(config: ServerConfig) -> BatchStore:
    """The Batch API's store: --batch-dir, or under the user's state folder; UnsafeFolder (an
    OSError) for a folder another user owns or may write."""
    return BatchStore(Path(config.batch_dir) if config.batch_dir else state_root(),
                      config.batch_disk_bytes)


def batches(app: Starlette, config: ServerConfig, store: BatchStore,
            client: EngineClient) -> Batches:
    """The Batch API over this app's handlers: its requests at the lowest priority where the
    engine schedules by priority, and only while direct requests hold less than half the
    server's queue (`--max-queue`)."""
    lowest = 2**31 - 1 if config.engine.scheduling_policy == "priority" else None
    half = max(1, config.max_queue // 2)
    runner = BatchRunner(store, in_process(app, BATCH_HANDLERS), config.batch_concurrency,
                         config.max_body_bytes, lowest,
                         room=lambda n: client.num_in_flight + min(n, half) <= half,
                         max_output_bytes=config.max_batch_output_bytes)
    return Batches(store, runner)


@contextlib.asynccontextmanager
async def _serving(app: Starlette, config: ServerConfig, store: BatchStore) -> AsyncIterator[None]:
    """The engine started, and the app's state and the Batch API's runner over it, until the
    block ends."""
    tokenizer, limits, handle, reasoning = await asyncio.to_thread(_start_engine, config)
    client = EngineClient(handle, config.max_queue)
    client.start()
    metrics = Metrics()
    metrics.weight_bytes.set(handle.ready.weight_bytes)
    metrics.kv_pool_bytes.set(handle.ready.kv_pool_bytes)
    grammars = GrammarChecker(resolve_model(config.engine.model), handle.ready.vocab_size,
                              handle.ready.eos_token_ids, config.grammar_compile_timeout_s,
                              config.grammar_compile_memory_bytes)
    state = app.state.server = ServerState(
        config, client, tokenizer, limits, metrics, config.engine.model, grammars,
        adapters=dict(config.engine.lora_modules), reasoning=reasoning,
    )
    try:
        state.batches = batches(app, config, store, client)
        async with running(state.batches.runner):
            yield
    finally:
        grammars.close()
        await client.close()


def create_app(config: ServerConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = await asyncio.to_thread(batch_store, config)  # refused before the engine starts
        with contextlib.closing(store):  # its folder's lock let go on every path
            async with _serving(app, config, store):
                yield

    table = [
        Route("/", chat_page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/generate", routes.generate, methods=["POST"]),
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        *(Route(path, info_routes.model_info, methods=["GET"])
          for path in ("/model_info", "/get_model_info")),
        *(Route(path, info_routes.server_info, methods=["GET"])
          for path in ("/server_info", "/get_server_info")),
        Route("/v1/responses", responses.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", responses.response_input_items,
              methods=["GET"]),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        Route("/get_load", info_routes.get_load, methods=["GET"]),
        Route("/kv_event_sources", info_routes.kv_event_sources, methods=["GET"]),
        Route("/v1/files", batch_routes.upload_file, methods=["POST"]),
        Route("/v1/files", batch_routes.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", batch_routes.get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", batch_routes.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", batch_routes.file_content, methods=["GET"]),
        Route("/v1/batches", batch_routes.create_batch, methods=["POST"]),
        Route("/v1/batches", batch_routes.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", batch_routes.get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batch_routes.cancel_batch, methods=["POST"]),
        Route("/v1/load_lora_adapter", lora_routes.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", lora_routes.unload_lora_adapter, methods=["POST"]),
        Route("/load_lora_adapter", lora_routes.sglang_load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", lora_routes.sglang_unload_lora_adapter, methods=["POST"]),
    ]
    if config.debug:
        table.append(Route("/debug/integrity", routes.integrity, methods=["GET"]))
    app = Starlette(routes=table, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.add_middleware(SendTimeoutMiddleware, send_timeout_s=config.send_timeout_s)
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=config.api_keys)
    # outermost: a foreign Host or a non-JSON body is refused before anything else
    app.add_middleware(OriginGuardMiddleware, bind=config.host, allowed_hosts=config.allowed_hosts)
    return app


async def chat_page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown paths (404) and methods (405) in OpenAI's error shape, not Starlette's plain text."""
    message = f"{exc.detail}: {request.method} {request.url.path}"
    headers = exc.headers
    if exc.status_code == 405 and headers and "Allow" in headers:
        message += f" (allowed: {headers['Allow']})"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    response = error_response(ProtocolError(message, status=exc.status_code, kind=kind))
    response.headers.update(headers or {})
    return response


class ApiKeyMiddleware:
    """Every endpoint except /health and the chat page's files (GET / and /static/...: the page then
    asks for the key) requires `Authorization: Bearer KEY`, KEY one of the server's keys."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app, self.expected = app, [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _open_path(scope):
            given = dict(scope["headers"]).get(b"authorization", b"")
            # every key compared (no early exit), each in constant time
            if not sum(hmac.compare_digest(given, key) for key in self.expected):
                err = ProtocolError(
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    status=401,
                    code="invalid_api_key",
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _open_path(scope: Scope) -> bool:
    """What needs no key: /health, and reading the chat page and its static files."""
    path = scope["path"]
    if path == "/health":
        return True
    return scope["method"] in ("GET", "HEAD") and (path == "/" or path.startswith("/static/"))
