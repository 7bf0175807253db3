"""The Responses API's stored responses, for `previous_response_id` and `GET /v1/responses/{id}`
(with its input items): the latest ones, at most `capacity` of them and `capacity_bytes` of their
JSON, in memory (gone at restart). Each belongs to the API key that made it (`server/owners.py`):
to another key it is as unknown as an id never answered."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

from server.request_errors import ProtocolError

STORE_CAPACITY = 1024
STORE_CAPACITY_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response: its conversation as chat messages (its own output last), the response
    object as answered, its input items, and the owner of the key that made it."""

    messages: list[dict]
    response: dict
    input_items: list[dict]
    owner: str


@dataclass
class ResponseStore:
    capacity: int = STORE_CAPACITY
    capacity_bytes: int = STORE_CAPACITY_BYTES
    _kept: collections.OrderedDict[str, tuple[Stored, int]] = field(
        default_factory=collections.OrderedDict)
    _bytes: int = 0

    def put(self, response_id: str, stored: Stored) -> None:
        """Keep it, dropping the oldest beyond either capacity (one larger than `capacity_bytes`
        alone is not kept)."""
        size = len(json.dumps([stored.messages, stored.response, stored.input_items],
                              ensure_ascii=False).encode())
        if size > self.capacity_bytes:
            return
        self.delete(response_id)
        self._kept[response_id] = (stored, size)
        self._bytes += size
        while len(self._kept) > self.capacity or self._bytes > self.capacity_bytes:
            self._bytes -= self._kept.popitem(last=False)[1][1]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, response_id: str, owner: str,
            param: str | None = "previous_response_id") -> Stored:
        """The response `owner` stored as `response_id`; a 404 when there is none (another
        owner's included)."""
        kept = self._kept.get(response_id)
        if kept is None or kept[0].owner != owner:
            raise ProtocolError(f"no stored response {response_id[:64]!r} (the server keeps the "
                                f"latest {self.capacity}, up to {self.capacity_bytes >> 20} MiB, "
                                "in memory)", param, 404, code="not_found")
        return kept[0]

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._bytes -= kept[1]
        return kept is not None
