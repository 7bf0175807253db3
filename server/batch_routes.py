"""OpenAI's Files and Batches endpoints (`server/batch`): `POST /v1/files` (multipart: `file`, and
`purpose` "batch"), `GET /v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE
/v1/files/{id}`; `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`, `POST
/v1/batches/{id}/cancel`. Each file and batch belongs to the API key that made it: another key
finds no such object (404), as for an id the store never made. An upload is refused past
`--max-batch-file-mb` or the store's disk budget (`--batch-disk-gb`), and from a web page on
another origin (a form needs no CORS preflight, so the JSON-only rule cannot guard this one)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import anyio
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from server.batch.lines import ENDPOINTS
from server.batch.store import public
from server.handlers import (
    endpoint,
    json_response,
    list_page,
    only_queries,
    read_json,
    state_of,
)
from server.origin_guard import host_name, is_loopback
from server.owners import request_owner as _owner
from server.protocol import check_fields, get_str, require_object
from server.request_errors import ProtocolError

BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one window OpenAI offers


@endpoint("files")
async def upload_file(request: Request) -> Response:
    st = state_of(request)
    _refuse_other_origins(request)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ProtocolError("an upload is a multipart/form-data body with 'file' and 'purpose'",
                            "file", status=415, code="unsupported_media_type")
    limit = st.config.max_batch_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + (1 << 20):
        raise _too_big(limit)
    try:
        with anyio.fail_after(st.config.read_timeout_s):
            form = await MultiPartParser(request.headers, _capped(request, limit + (1 << 20)),
                                         max_files=1, max_fields=1).parse()
    except TimeoutError:
        raise ProtocolError("the upload did not arrive in time", status=408,
                            code="request_timeout") from None
    except MultiPartException as e:
        raise ProtocolError(f"the upload is not a valid form: {e.message}", "file") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise ProtocolError("'purpose' must be 'batch' (the only purpose this server keeps)",
                                "purpose")
        if not isinstance(upload, UploadFile):
            raise ProtocolError("'file' is required", "file")
        name = Path(upload.filename or "upload.jsonl").name[:256]
        await upload.seek(0)
        obj = await asyncio.to_thread(st.batches.store.add_upload, upload.file, name,
                                      _owner(request), limit)
    finally:
        await form.close()
    return json_response(public(obj))


async def _capped(request: Request, limit: int):
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_big(limit)
        yield chunk


def _too_big(limit: int) -> ProtocolError:
    return ProtocolError(f"the file is larger than {limit} bytes (--max-batch-file-mb)", "file",
                         status=413)


def _refuse_other_origins(request: Request) -> None:
    """A browser sends `Origin` with a cross-site form post; API clients send none."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    name = host_name(origin.split("://", 1)[-1].split("/", 1)[0]).lower()
    if name != host_name(request.headers.get("host", "")).lower() and not is_loopback(name):
        raise ProtocolError(f"uploads from a page on {origin[:80]!r} are refused", status=403,
                            code="origin_not_allowed")


@endpoint("files")
async def list_files(request: Request) -> Response:
    st = state_of(request)
    only_queries(request.query_params, {"purpose", "limit", "after", "order"})
    objs = await asyncio.to_thread(st.batches.store.list_files,
                                   request.query_params.get("purpose"), _owner(request))
    return json_response(list_page([public(o) for o in objs], request.query_params))


@endpoint("files")
async def get_file(request: Request) -> Response:
    st = state_of(request)
    return json_response(public(await asyncio.to_thread(
        st.batches.store.file, request.path_params["file_id"], _owner(request))))


@endpoint("files")
async def file_content(request: Request) -> Response:
    st = state_of(request)
    content = await asyncio.to_thread(st.batches.store.open_content,
                                      request.path_params["file_id"], _owner(request))
    size = os.fstat(content.fileno()).st_size
    return StreamingResponse(_read(content), media_type="application/jsonl",
                             headers={"content-length": str(size)})


async def _read(content: BinaryIO) -> AsyncIterator[bytes]:
    """An open file's bytes, a MiB at a time off the event loop; the file closed at the end."""
    try:
        while chunk := await asyncio.to_thread(content.read, 1 << 20):
            yield chunk
    finally:
        content.close()


@endpoint("files")
async def delete_file(request: Request) -> Response:
    st = state_of(request)
    file_id = request.path_params["file_id"]
    await asyncio.to_thread(st.batches.store.delete_file, file_id, _owner(request))
    return json_response({"id": file_id, "object": "file", "deleted": True})


@endpoint("batches")
async def create_batch(request: Request) -> Response:
    st = state_of(request)
    body = require_object(await read_json(request))
    check_fields(body, BATCH_FIELDS)
    url = get_str(body, "endpoint", None)
    if url not in ENDPOINTS:
        raise ProtocolError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if get_str(body, "completion_window", None) != "24h":
        raise ProtocolError("'completion_window' must be '24h'", "completion_window")
    metadata = _metadata(body.get("metadata"))
    file_id = get_str(body, "input_file_id", None)
    if file_id is None:
        raise ProtocolError("'input_file_id' is required", "input_file_id")
    store, owner = st.batches.store, _owner(request)
    if (await asyncio.to_thread(store.file, file_id, owner, "input_file_id"))["purpose"] != "batch":
        raise ProtocolError(f"file {file_id[:80]!r} is not a batch input file", "input_file_id")
    now = int(time.time())
    batch = await asyncio.to_thread(store.new_batch, {
        "endpoint": url, "errors": None, "input_file_id": file_id, "completion_window": "24h",
        "status": "validating", "output_file_id": None, "error_file_id": None,
        "created_at": now, "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S,
        "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata},
        owner)
    st.batches.runner.wake()
    return json_response(public(batch))


@endpoint("batches")
async def get_batch(request: Request) -> Response:
    st = state_of(request)
    bid, owner = request.path_params["batch_id"], _owner(request)
    live = st.batches.runner.live(bid, owner)
    return json_response(public(live or await asyncio.to_thread(st.batches.store.batch, bid,
                                                                owner)))


@endpoint("batches")
async def list_batches(request: Request) -> Response:
    st = state_of(request)
    only_queries(request.query_params, {"limit", "after"})
    objs = await asyncio.to_thread(st.batches.store.list_batches, _owner(request))
    return json_response(list_page([public(o) for o in objs], request.query_params))


@endpoint("batches")
async def cancel_batch(request: Request) -> Response:
    st = state_of(request)
    return json_response(public(await st.batches.runner.cancel(request.path_params["batch_id"],
                                                               _owner(request))))


def _metadata(value: object) -> dict | None:
    """OpenAI's metadata: at most 16 string pairs, keys of 64 and values of 512 characters."""
    if value is None:
        return None
    ok = (isinstance(value, dict) and len(value) <= 16
          and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                  for k, v in value.items()))
    if not ok:
        raise ProtocolError("'metadata' holds at most 16 strings (keys of 64 characters, values "
                            "of 512)", "metadata")
    return value
