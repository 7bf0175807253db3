"""Loading and unloading LoRA adapters while serving: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (plain-text success, OpenAI-shaped errors) and SGLang's
`/load_lora_adapter` and `/unload_lora_adapter` (`{"success", "error_message", "loaded_adapters"}`).
Every engine rank reads and checks the adapter; a bad one is a 400 and changes nothing. An adapter
that running requests use is not unloaded (400: unload it once they finish).

The routes are off unless the operator turns them on (`--allow-runtime-lora-updating` or vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): vLLM registers them only then, so off they answer vLLM's 404,
with a message that names the flag. On, a client's `lora_path` is read only from inside
`--lora-dir` (`compiled_engine.lora.folder`): every path outside it gets one refusal, whatever is
there. As in vLLM, with the routes on a client may unload any adapter, `--lora-modules`' too."""

from __future__ import annotations

import asyncio
import os

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from compiled_engine.lora.folder import OUTSIDE, confined
from server.handlers import endpoint, json_response, read_json, state_of
from server.protocol import ProtocolError, check_fields, get_bool, get_int, get_str, require_object
from server.state import ServerState

# every rank reads the adapter's file; a load not read within 90 s is refused by the ranks
# (ranks/adapter_wait.py: READ_DEADLINE_S), so a client told it timed out is told the truth
LORA_TIMEOUT_S = 120.0
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX
RUNTIME_OFF = ("loading and unloading LoRA adapters while serving is off on this server: its "
               "operator turns it on with --allow-runtime-lora-updating (or "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) and --lora-dir")
NO_FOLDER = ("this server loads no adapter at runtime: it was started without --lora-dir, the "
             "folder such loads read from")


def _runtime_on(st: ServerState) -> None:
    """404 (vLLM's answer: the routes are not there) unless runtime updating is on."""
    if not st.config.allow_runtime_lora_updating:
        raise ProtocolError(RUNTIME_OFF, status=404, code="runtime_lora_updating_off")


def _confined(st: ServerState, path: str) -> tuple[str, str]:
    """`--lora-dir`'s real path and the real path of a client's `lora_path` inside it; one
    refusal for any path outside."""
    if st.config.lora_dir is None:
        raise ProtocolError(NO_FOLDER, "lora_path")
    root = os.path.realpath(st.config.lora_dir)
    real = confined(root, path)
    if real is None:
        raise ProtocolError(OUTSIDE, "lora_path")
    return root, real


def _lora_on(st: ServerState) -> None:
    if not st.config.engine.enable_lora:
        raise ProtocolError("this server serves no LoRA adapters: start it with --enable-lora")


def _required(body: dict, field: str, max_chars: int) -> str:
    value = get_str(body, field, None)
    if not value:
        raise ProtocolError(f"'{field}' is required", field)
    if len(value) > max_chars:
        raise ProtocolError(f"'{field}' has {len(value)} characters, more than {max_chars}", field)
    return value


def _name(body: dict) -> str:
    return _required(body, "lora_name", MAX_NAME_CHARS)


async def _load(st: ServerState, body: dict) -> str:
    """The adapter's name once every rank serves it; ProtocolError why not."""
    _lora_on(st)
    name = _name(body)
    path = _required(body, "lora_path", MAX_PATH_CHARS)
    if name in st.adapters or name in st.model_names:
        raise ProtocolError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    root, path = _confined(st, path)
    try:
        reply = await st.client.load_lora(name, path, LORA_TIMEOUT_S, root)
    except asyncio.TimeoutError:
        raise ProtocolError(f"reading the adapter took longer than {LORA_TIMEOUT_S:.0f} s: it is "
                            "not loaded", "lora_path", status=503, kind="server_error") from None
    if reply.error is not None:
        raise ProtocolError(reply.error, "lora_path", status=reply.status)
    st.adapters[name] = path
    return name


async def _unload(st: ServerState, body: dict) -> str:
    _lora_on(st)
    name = _name(body)
    if name not in st.adapters:
        raise ProtocolError(f"The lora adapter '{name}' cannot be found.", "lora_name", status=404)
    reply = await st.client.unload_lora(name, LORA_TIMEOUT_S)
    if reply.error is not None:
        raise ProtocolError(reply.error, "lora_name", status=reply.status)
    del st.adapters[name]
    return name


@endpoint("load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """vLLM's: {"lora_name", "lora_path"}."""
    _runtime_on(state_of(request))
    body = require_object(await read_json(request))
    check_fields(body, frozenset({"lora_name", "lora_path", "load_inplace"}))
    if get_bool(body, "load_inplace", False):
        raise ProtocolError("load_inplace is not supported: unload the adapter, then load it",
                            "load_inplace")
    name = await _load(state_of(request), body)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@endpoint("unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's: {"lora_name"} (and its optional `lora_int_id`, which names nothing more here)."""
    _runtime_on(state_of(request))
    body = require_object(await read_json(request))
    check_fields(body, frozenset({"lora_name", "lora_int_id"}))
    get_int(body, "lora_int_id", None, 0, 2**63)
    name = await _unload(state_of(request), body)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _sglang(request: Request, fields: frozenset[str], load: bool) -> Response:
    """SGLang's answer: 200 with success true, else 400 (every failure, as SGLang) with its
    message; off, vLLM's 404 as the other routes."""
    st = state_of(request)
    _runtime_on(st)
    try:
        body = require_object(await read_json(request))
        check_fields(body, fields)
        if get_bool(body, "pinned", False):
            raise ProtocolError("pinned adapters are not supported", "pinned")
        await (_load if load else _unload)(st, body)
    except ProtocolError as e:
        return json_response({"success": False, "error_message": e.message,
                              "loaded_adapters": dict(st.adapters)}, 400)
    return json_response({"success": True, "error_message": None,
                          "loaded_adapters": dict(st.adapters)})


@endpoint("load_lora_adapter")
async def sglang_load_lora_adapter(request: Request) -> Response:
    """SGLang's: {"lora_name", "lora_path"}."""
    return await _sglang(request, frozenset({"lora_name", "lora_path", "pinned"}), load=True)


@endpoint("unload_lora_adapter")
async def sglang_unload_lora_adapter(request: Request) -> Response:
    return await _sglang(request, frozenset({"lora_name"}), load=False)
