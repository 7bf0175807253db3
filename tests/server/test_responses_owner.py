"""Stored responses belong to the API key that made them: to another key a response id is as
unknown as one never answered (the same 404, on retrieve, input items, delete, cancel and
`previous_response_id`), while its own key still reads and continues it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from server.request_errors import ProtocolError
from server.response_store import ResponseStore, Stored
from tests.helpers.servers import RunningServer, start_server

pytestmark = pytest.mark.slow
KEYS = ("key-of-ann", "key-of-bo")


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningServer]:
    """Two API keys; eager (its answers are not what these tests compare)."""
    with start_server(engine={"enforce_eager": True, "num_pages": 512}, api_keys=KEYS) as running:
        yield running


def as_key(server: RunningServer, key: str) -> httpx.Client:
    return server.http(headers={"Authorization": f"Bearer {key}"})


def unreachable(client: httpx.Client, rid: str) -> dict[str, dict]:
    """What `client` is answered for each way of reaching the stored response `rid`."""
    asks = {"retrieve": ("GET", f"/v1/responses/{rid}", None),
            "input_items": ("GET", f"/v1/responses/{rid}/input_items", None),
            "cancel": ("POST", f"/v1/responses/{rid}/cancel", None),
            "continue": ("POST", "/v1/responses", {"model": "demo", "input": "And then?",
                                                   "max_output_tokens": 2,
                                                   "previous_response_id": rid}),
            "delete": ("DELETE", f"/v1/responses/{rid}", None)}
    out = {}
    for name, (method, path, body) in asks.items():
        r = client.request(method, path, json=body)
        assert r.status_code == 404, (name, r.text)
        out[name] = r.json()
    return out


def test_another_key_finds_no_such_response(keyed: RunningServer) -> None:
    with as_key(keyed, KEYS[0]) as ann, as_key(keyed, KEYS[1]) as bo:
        made = ann.post("/v1/responses", json={"model": "demo", "input": "Hi",
                                               "max_output_tokens": 2})
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        to_bo = unreachable(bo, rid)
        assert ann.get(f"/v1/responses/{rid}").json() == made.json()  # Bo's delete left it
        items = ann.get(f"/v1/responses/{rid}/input_items").json()["data"]
        assert [i["content"][0]["text"] for i in items] == ["Hi"]
        follow = ann.post("/v1/responses", json={"model": "demo", "input": "And then?",
                                                 "max_output_tokens": 2,
                                                 "previous_response_id": rid})
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == rid
        assert ann.delete(f"/v1/responses/{rid}").json()["deleted"] is True
        # once gone, Ann is answered for her own id what Bo was answered all along
        assert unreachable(ann, rid) == to_bo
        assert to_bo["retrieve"]["error"]["code"] == "not_found"


def test_the_store_answers_another_owner_as_for_an_unknown_id() -> None:
    store = ResponseStore()
    store.put("resp_1", Stored([], {"id": "resp_1"}, [], owner="ann"))
    assert store.get("resp_1", "ann").response == {"id": "resp_1"}
    with pytest.raises(ProtocolError) as theirs:
        store.get("resp_1", "bo")
    store.delete("resp_1")
    with pytest.raises(ProtocolError) as unknown:
        store.get("resp_1", "ann")
    assert theirs.value.body() == unknown.value.body() and theirs.value.status == 404
