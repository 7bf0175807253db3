"""A batch input file's lines (OpenAI's format: `{"custom_id", "method": "POST", "url", "body"}`),
read one at a time (a file is never held whole) and checked before a batch runs: each line JSON of
that shape, at most `max_line_bytes`, on the batch's endpoint, not streamed, custom ids unique, at
most `MAX_LINES`; what each asks of the engine (`sequences`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 20  # validation errors reported of a failed batch


@dataclass(frozen=True, slots=True)
class BatchLine:
    number: int  # 1-based
    custom_id: str
    url: str
    body: dict


class LineError(ValueError):
    def __init__(self, code: str, message: str, line: int, param: str | None = None) -> None:
        super().__init__(message)
        self.error = {"code": code, "message": message, "param": param, "line": line}


def read_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(number, raw line) of each non-blank line; a line past `max_line_bytes` is a LineError."""
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(max_line_bytes + 2)
            if not raw:
                return
            number += 1
            if len(raw) > max_line_bytes + 1 or (len(raw) == max_line_bytes + 1 and
                                                  not raw.endswith(b"\n")):
                raise LineError("line_too_long", f"line {number} is longer than "
                                f"{max_line_bytes} bytes", number)
            if raw.strip():
                yield number, raw


def parse_line(number: int, raw: bytes, endpoint: str | None) -> BatchLine:
    """A line on `endpoint` (None: any of `ENDPOINTS`); LineError saying what is wrong."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        raise LineError("invalid_json_line", f"line {number} is not valid JSON", number) from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {number} is not a JSON object", number)
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise LineError("invalid_request", f"line {number} has an unknown field "
                        f"{sorted(unknown)[0][:64]!r}", number, sorted(unknown)[0][:64])
    custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        raise LineError("invalid_request", f"line {number}: 'custom_id' must be a string of 1 to "
                        "512 characters", number, "custom_id")
    if obj.get("method") != "POST":
        raise LineError("invalid_request", f"line {number}: 'method' must be 'POST'", number,
                        "method")
    if url != endpoint and not (endpoint is None and url in ENDPOINTS):
        wanted = f"the batch's endpoint {endpoint!r}" if endpoint else f"one of {ENDPOINTS}"
        raise LineError("mismatched_endpoint", f"line {number}: 'url' must be {wanted}", number,
                        "url")
    if not isinstance(body, dict):
        raise LineError("invalid_request", f"line {number}: 'body' must be an object", number,
                        "body")
    if body.get("stream"):
        raise LineError("invalid_request", f"line {number}: a batch request cannot stream",
                        number, "body.stream")
    return BatchLine(number, custom_id, url, body)


def check_file(path: Path, endpoint: str | None,
               max_line_bytes: int) -> tuple[int, list[dict]]:
    """The file's request count and its errors (the first `MAX_ERRORS`; none: it may run)."""
    errors, seen, count = [], set(), 0
    try:
        for number, raw in read_lines(path, max_line_bytes):
            count += 1
            try:
                line = parse_line(number, raw, endpoint)
                if line.custom_id in seen:
                    raise LineError("duplicate_custom_id", f"line {number}: custom_id "
                                    f"{line.custom_id[:64]!r} is not unique", number, "custom_id")
                seen.add(line.custom_id)
            except LineError as e:
                errors.append(e.error)
            if len(errors) >= MAX_ERRORS:
                break
            if count > MAX_LINES:
                errors.append({"code": "too_many_requests", "message": f"a batch holds at most "
                               f"{MAX_LINES} requests", "param": None, "line": number})
                break
    except LineError as e:  # a line too long: the file cannot be read on
        errors.append(e.error)
    if not count and not errors:
        errors.append({"code": "empty_file", "message": "the input file holds no request",
                       "param": None, "line": None})
    return count, errors


def sequences(line: BatchLine) -> int:
    """The sequences a line asks the engine for: `n` for each prompt (a list of prompts, or of
    embeddings' inputs, is one each; a list of token ids is one)."""
    n = line.body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    field = line.body.get("input" if line.url == "/v1/embeddings" else "prompt")
    many = isinstance(field, list) and any(not isinstance(p, int) for p in field)
    return n * (len(field) if many else 1)


def lines(path: Path, endpoint: str | None, max_line_bytes: int) -> Iterator[BatchLine]:
    """A checked file's lines, in order."""
    for number, raw in read_lines(path, max_line_bytes):
        yield parse_line(number, raw, endpoint)
