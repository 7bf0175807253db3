"""The Responses API's stored responses, for `previous_response_id`: the latest `capacity`, in
memory (gone at restart)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from server.request_errors import ProtocolError

STORE_CAPACITY = 1024


@dataclass
class ResponseStore:
    """Each stored response's conversation as chat messages, its own output last."""

    capacity: int = STORE_CAPACITY
    _kept: collections.OrderedDict[str, list[dict]] = field(
        default_factory=collections.OrderedDict)

    def put(self, response_id: str, messages: list[dict]) -> None:
        self._kept[response_id] = messages
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> list[dict]:
        if response_id not in self._kept:
            raise ProtocolError(f"no stored response {response_id!r} (the server keeps the latest "
                                f"{self.capacity}, in memory)", "previous_response_id", 404,
                                code="not_found")
        return self._kept[response_id]
