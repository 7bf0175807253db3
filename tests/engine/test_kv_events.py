"""KV events (`--kv-events-config`): the radix cache's stores and evictions reach a ZMQ subscriber
in vLLM's wire format, decoded here as a router decodes them (plain msgpack, no shared types): the
frames, the batch array, the tagged event maps with every field a router requires, the hash chain
(a block's parent is the hash of the page before it; a removal names the stored hashes), the
sequence numbers, and replay."""

from __future__ import annotations

import hashlib
import struct
import time

import msgspec
import pytest
import zmq

from compiled_engine import LLM, SamplingParams
from compiled_engine.kv_events.config import KVEventsConfig
from compiled_engine.kv_events.publisher import KVEventPublisher
from compiled_engine.ranks.launcher import free_port
from compiled_engine.scheduler.allocator import PageAllocator
from compiled_engine.scheduler.prefix_cache import CacheRemoved, CacheStored
from compiled_engine.scheduler.radix_cache import RadixCache
from compiled_engine.scheduler.request import ADAPTER_SHIFT

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "lora_name"]


def subscriber(endpoint: str, timeout_ms: int = 10_000) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(endpoint)
    time.sleep(1.0)  # the slow joiner: a SUB misses what is sent before it is connected
    return sock


def receive(sock: zmq.Socket) -> tuple[int, list]:
    topic, seq, payload = sock.recv_multipart()
    assert topic == b"" and len(seq) == 8
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 2 and isinstance(batch[0], float), batch
    return int.from_bytes(seq, "big"), batch[1]


def received(sock: zmq.Socket, batches: int) -> list:
    """The events of up to `batches` batches, until nothing more comes within the timeout."""
    events: list = []
    for _ in range(batches):
        try:
            events.extend(receive(sock)[1])
        except zmq.Again:
            break
    return events


def test_the_radix_cache_records_what_it_stores_and_evicts() -> None:
    cache = RadixCache(PageAllocator(16, page_size=2))
    cache.events = []
    pages = cache.allocator.alloc(3)
    cache.insert((1, 2, 3, 4, 5, 6), pages)
    more = cache.allocator.alloc(1)
    cache.insert((1, 2, 3, 4, 9, 9), (*pages[:2], *more))  # a branch after two pages
    cache.insert((1, 2, 3, 4), pages[:2])  # nothing new
    assert cache.events == [CacheStored((1, 2, 3, 4, 5, 6), 0, tuple(pages)),
                            CacheStored((1, 2, 3, 4, 9, 9), 4, tuple(more))]
    cache.events = []
    assert cache.evict(16) == 4
    assert sorted(cache.events, key=lambda e: e.path) == [
        CacheRemoved((1, 2, 3, 4), 0), CacheRemoved((1, 2, 3, 4, 5, 6), 4),
        CacheRemoved((1, 2, 3, 4, 9, 9), 4),
    ]
    assert cache.events[-1] == CacheRemoved((1, 2, 3, 4), 0)  # a parent after its children


def test_the_wire_format_hash_chain_sequence_and_replay() -> None:
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=endpoint, replay_endpoint=replay), 2)
    sub = subscriber(endpoint)
    try:
        pub.publish([CacheStored((1, 2, 3, 4), 0)])
        pub.publish([CacheStored((1, 2, 3, 4, 5, 6), 4), CacheRemoved((1, 2, 3, 4, 5, 6), 4)])
        seq0, (root,) = receive(sub)
        seq1, (child, removed) = receive(sub)
        assert (seq0, seq1) == (1, 2)  # seq 0 was the start's AllBlocksCleared
        assert list(root) == STORED_KEYS and list(child) == STORED_KEYS
        assert root["type"] == "BlockStored" and root["parent_block_hash"] is None
        assert root["token_ids"] == [1, 2, 3, 4] and root["block_size"] == 2
        assert root["medium"] == "GPU" and root["lora_id"] is None and root["lora_name"] is None
        assert len(root["block_hashes"]) == 2 and len(set(root["block_hashes"])) == 2
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in root["block_hashes"])
        assert child["parent_block_hash"] == root["block_hashes"][-1]
        assert child["token_ids"] == [5, 6]
        assert removed == {"type": "BlockRemoved", "block_hashes": child["block_hashes"],
                           "medium": "GPU"}

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = [dealer.recv_multipart() for _ in range(3)]
        assert [(e, t, int.from_bytes(q, "big")) for e, t, q, _ in replayed] == [
            (b"", b"", 0), (b"", b"", 1), (b"", b"", 2)]
        assert [msgspec.msgpack.decode(p)[1] for *_, p in replayed] == [
            [{"type": "AllBlocksCleared"}], [root], [child, removed]]
        assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()


def test_block_hashes_chain_sha256_of_the_pages_as_documented() -> None:
    """Routers share one index across replicas: a block's hash depends on its prefix's tokens only
    (sha256 of the previous page's digest and the page's uint32 tokens, the last 8 bytes)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=endpoint), 2)
    sub = subscriber(endpoint)
    try:
        pub.publish([CacheStored((7, 8, 9, 10), 0)])
        (event,) = receive(sub)[1]
    finally:
        sub.close(linger=0)
        pub.shutdown()
    first = hashlib.sha256(struct.pack("<2I", 7, 8)).digest()
    second = hashlib.sha256(first + struct.pack("<2I", 9, 10)).digest()
    assert event["block_hashes"] == [int.from_bytes(d[-8:], "big") for d in (first, second)]


def test_an_adapters_pages_carry_its_id_and_hash_apart() -> None:
    """A LoRA adapter's pages (their cache keys salted with its id): the plain token ids, the
    adapter's id as `lora_id`, and hashes chained from the adapter's, so that the same tokens under
    the base model or another adapter never share a block."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=endpoint), 2)
    sub = subscriber(endpoint)
    salted = tuple((3 << ADAPTER_SHIFT) | t for t in (7, 8, 9, 10))
    try:
        pub.publish([CacheStored((7, 8, 9, 10), 0), CacheStored(salted, 0)])
        base, adapter = receive(sub)[1]
    finally:
        sub.close(linger=0)
        pub.shutdown()
    assert adapter["token_ids"] == base["token_ids"] == [7, 8, 9, 10]
    assert adapter["lora_id"] == 3 and base["lora_id"] is None
    first = hashlib.sha256(hashlib.sha256(b"lora" + (3).to_bytes(8, "little")).digest()
                           + struct.pack("<2I", 7, 8)).digest()
    assert adapter["block_hashes"][0] == int.from_bytes(first[-8:], "big")
    assert not set(adapter["block_hashes"]) & set(base["block_hashes"])


def test_a_served_prompt_is_published_then_its_eviction(demo_dir: str) -> None:
    """The engine publishes a finished prompt's pages (stored) and, under pressure from other
    prompts in a tiny pool, their eviction."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(demo_dir, enforce_eager=True, num_pages=48, max_running=2,
              kv_events={"enable_kv_cache_events": True, "endpoint": endpoint})
    sub = subscriber(endpoint, timeout_ms=2_000)
    try:
        first = list(range(10, 30))
        llm.generate([first], SamplingParams(max_tokens=2, temperature=0))
        for start in (100, 200, 300):
            llm.generate([list(range(start, start + 20))], SamplingParams(max_tokens=2))
        events = received(sub, 100)
    finally:
        sub.close(linger=0)
        llm.engine.shutdown()
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored[0]["token_ids"][: len(first)] == first and stored[0]["parent_block_hash"] is None
    removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert removed and removed <= {h for e in stored for h in e["block_hashes"]}


def test_bad_configs_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="unknown field.*endpont"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpont": "tcp://x:1"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="hwm"):
        KVEventsConfig.parse({"hwm": 0})
    assert not KVEventsConfig.parse({"enable_kv_cache_events": False}).enabled
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled


def test_the_kv_tiers_pages_are_published_as_disk(demo_dir: str, tmp_path) -> None:
    """With a KV tier, the pages it writes are published again with medium "DISK" (the hashes of
    their "GPU" events), and those its byte budget evicts as removed from "DISK"."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(demo_dir, enforce_eager=True, num_pages=48, max_running=2,
              kv_cache_dir=str(tmp_path / "kv"), kv_cache_disk_gb=200e-6,
              kv_events={"enable_kv_cache_events": True, "endpoint": endpoint})
    sub = subscriber(endpoint, timeout_ms=2_000)
    try:
        for start in (10, 100, 200, 300, 400, 500):
            llm.generate([list(range(start, start + 20))], SamplingParams(max_tokens=2))
            llm.engine.tier.flush()
        llm.generate([[7, 8]], SamplingParams(max_tokens=1))  # publishes the last evictions
        events = received(sub, 200)
    finally:
        sub.close(linger=0)
        llm.engine.shutdown()
    by = {(e["type"], e["medium"]): {h for x in events if (x["type"], x["medium"]) ==
                                     (e["type"], e["medium"]) for h in x["block_hashes"]}
          for e in events}
    disk = by[("BlockStored", "DISK")]
    assert disk and disk <= by[("BlockStored", "GPU")]
    assert by.get(("BlockRemoved", "DISK")), "the byte budget evicted nothing published"
    assert by[("BlockRemoved", "DISK")] <= disk
