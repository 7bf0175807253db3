"""What the field's routers and autoscalers ask a worker about itself: SGLang's `/model_info` and
`/server_info` (and their older `/get_` names, which sglang-router falls back to), `/get_load`, and
vLLM's `/kv_event_sources` (where vllm-router's kv_aware policy subscribes to KV events)."""

from __future__ import annotations

import contextlib
import importlib.metadata

from starlette.requests import Request
from starlette.responses import Response

from compiled_engine.kv_events.config import KVEventsConfig
from server.engine_client import EngineDead
from server.handlers import json_response, state_of
from server.routes import STATS_MAX_AGE_S


async def model_info(request: Request) -> Response:
    st = state_of(request)
    return json_response({
        "model_path": st.model_name,
        "tokenizer_path": st.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "max_model_len": st.limits.max_context,
    })


async def server_info(request: Request) -> Response:
    st = state_of(request)
    engine = st.config.engine
    stats = {}
    with contextlib.suppress(TimeoutError, EngineDead):
        stats = (await st.client.recent_stats(STATS_MAX_AGE_S, st.config.health_timeout_s)).stats
    return json_response({
        "version": importlib.metadata.version("compiled-engine"),
        "model_path": st.model_name,
        "served_model_name": st.model_name,
        "tp_size": engine.tp_size,
        "dp_size": 1,
        "page_size": engine.page_size,
        "kv_block_size": engine.page_size,  # what a KV event's block is (vllm-router reads it)
        "max_running_requests": engine.max_running,
        "context_length": st.limits.max_context,
        "chunked_prefill_size": engine.chunk_budget,
        "speculative": engine.speculative,
        "internal_states": [stats],
    })


async def get_load(request: Request) -> Response:
    """`{"load": sequences in flight}` (running or waiting; what `--max-queue` bounds), from the
    server's own books: sglang-router's load-aware policies poll it, at no cost to the engine."""
    st = state_of(request)
    if not st.client.alive:
        return json_response({"error": {"message": st.client.dead_reason
                                        or "the engine is not running"}}, 503)
    return json_response({"load": st.client.num_in_flight})


async def kv_event_sources(request: Request) -> Response:
    """The KV event publisher of each data-parallel rank (one here), as vLLM lists it; 404 while
    the events are off."""
    config = KVEventsConfig.parse(state_of(request).config.engine.kv_events)
    if config is None or not config.enabled:
        return json_response({"error": {"message": "KV events are off (--kv-events-config)"}}, 404)
    return json_response({"0": {
        "endpoint": config.endpoint,
        "replay_endpoint": config.replay_endpoint,
        "topic": config.topic,
        "hwm": config.hwm,
        "buffer_steps": config.buffer_steps,
        "publisher": "zmq",
        "encoding": "msgpack",
        "schema_version": 1,
        "enable_kv_cache_events": True,
    }})
