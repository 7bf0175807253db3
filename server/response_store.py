"""The Responses API's stored responses, for `previous_response_id`: the latest ones, at most
`capacity` of them and `capacity_bytes` of their conversations' JSON, in memory (gone at
restart)."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

from server.request_errors import ProtocolError

STORE_CAPACITY = 1024
STORE_CAPACITY_BYTES = 64 << 20


@dataclass
class ResponseStore:
    """Each stored response's conversation as chat messages, its own output last."""

    capacity: int = STORE_CAPACITY
    capacity_bytes: int = STORE_CAPACITY_BYTES
    _kept: collections.OrderedDict[str, tuple[list[dict], int]] = field(
        default_factory=collections.OrderedDict)
    _bytes: int = 0

    def put(self, response_id: str, messages: list[dict]) -> None:
        """Keep it, dropping the oldest beyond either capacity (one larger than `capacity_bytes`
        alone is not kept)."""
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if size > self.capacity_bytes:
            return
        if response_id in self._kept:
            self._bytes -= self._kept.pop(response_id)[1]
        self._kept[response_id] = (messages, size)
        self._bytes += size
        while len(self._kept) > self.capacity or self._bytes > self.capacity_bytes:
            self._bytes -= self._kept.popitem(last=False)[1][1]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> list[dict]:
        if response_id not in self._kept:
            raise ProtocolError(f"no stored response {response_id!r} (the server keeps the latest "
                                f"{self.capacity}, up to {self.capacity_bytes >> 20} MiB, in "
                                "memory)", "previous_response_id", 404, code="not_found")
        return self._kept[response_id][0]
