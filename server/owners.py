"""Who a caller is to the stores that keep what clients made (the Batch API's files and batches,
the Responses API's stored responses): the API key it sent, as `owner_of` keeps it, or one owner
for all where the server takes no key."""

from __future__ import annotations

from starlette.requests import Request

from server.batch.store import NO_OWNER, owner_of
from server.handlers import state_of


def request_owner(request: Request) -> str:
    """The caller's owner: its API key (which the server's middleware checked), or `NO_OWNER`
    where the server takes no key."""
    if not state_of(request).config.api_keys:
        return NO_OWNER
    return owner_of(request.headers.get("authorization", "").removeprefix("Bearer "))
