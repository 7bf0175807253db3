"""Publishing the prefix cache's stores and evictions as vLLM's KV events.

Wire format (vLLM's `ZmqEventPublisher`, what `vllm-router --policy kv_aware` decodes): a PUB
socket sends one multipart message per engine step that changed the cache, `[topic, seq (8 bytes,
big-endian), payload]`; the payload is msgpack of `[ts, [event, ...]]`, each event a map tagged
`"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`. The first batch (seq 0) is
`AllBlocksCleared`: a replica that (re)starts has an empty cache. With `replay_endpoint`, a ROUTER
socket answers `[b"", start_seq]` with every buffered batch from `start_seq` on,
`[b"", topic, seq, payload]` each, then `[b"", b"", -1, b""]`.

A block is one KV page. Its hash chains the page's tokens to its prefix's hash (sha256, the last 8
bytes as an unsigned integer, as vLLM sends by default), so the same prefix has the same hashes on
every replica and after a restart: routers index the token ids and use the hashes as anchors
between a block and its parent. Hashing and sending run on the publisher's thread; the engine only
hands over its step's cache events."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import struct
import threading
import time
from collections import deque

import msgspec
import zmq

from compiled_engine.kv_events.config import KVEventsConfig
from compiled_engine.scheduler.prefix_cache import CacheRemoved, CacheStored
from compiled_engine.scheduler.request import SALT_BITS, split_cache_key

log = logging.getLogger(__name__)

# vLLM's name for the engine's own KV pool (not an offload tier), whatever the device: vllm-router
# indexes only blocks in "GPU"; the KV tier's pages are "DISK" (vLLM's name for its disk offload)
MEDIUM = "GPU"
DISK = "DISK"
REPLAY_END = (-1).to_bytes(8, "big", signed=True)
START_TIMEOUT_S = 10.0


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def chain_hashes(path: tuple[int, ...], page_size: int) -> list[bytes]:
    """The chained hash of every page of `path` (page-aligned), in order: sha256 of the previous
    page's hash and the page's tokens as little-endian uint32. The first page chains from nothing,
    or under a LoRA adapter from the hash of its id, and under a cache salt (vLLM's, mixed into
    its first block's hash) from the hash of that and the salt's namespace: tenants of other salts
    share no block hash."""
    adapter, salt_ns, path = split_cache_key(path)
    out = []
    prev = hashlib.sha256(b"lora" + adapter.to_bytes(8, "little")).digest() if adapter else b""
    if salt_ns:
        prev = hashlib.sha256(prev + b"cache_salt" + salt_ns.to_bytes(SALT_BITS // 8, "big"))
        prev = prev.digest()
    for i in range(0, len(path), page_size):
        prev = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *path[i : i + page_size]))
        prev = prev.digest()
        out.append(prev)
    return out


def external(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def to_events(
    cache_events: list[CacheStored | CacheRemoved] | list[int], page_size: int,
    medium: str = MEDIUM,
) -> list[BlockStored | BlockRemoved]:
    """Cache events as vLLM's; a list of block hashes instead: their removal from `medium`."""
    if cache_events and isinstance(cache_events[0], int):
        return [BlockRemoved(list(cache_events), medium)]
    out: list[BlockStored | BlockRemoved] = []
    for ev in cache_events:
        hashes = chain_hashes(ev.path, page_size)
        first = ev.start // page_size
        own = [external(h) for h in hashes[first:]]
        if isinstance(ev, CacheStored):
            parent = external(hashes[first - 1]) if first else None
            adapter, _, tokens = split_cache_key(ev.path)
            out.append(BlockStored(own, parent, list(tokens[ev.start :]), page_size,
                                   adapter or None, medium, None))
        else:
            out.append(BlockRemoved(own, medium))
    return out


class KVEventPublisher:
    """Owns the sockets on its own thread; `publish` queues one step's cache events."""

    def __init__(self, config: KVEventsConfig, page_size: int) -> None:
        self.config, self.page_size = config, page_size
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._started = threading.Event()
        self._error: str | None = None
        self._dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError("kv events: the publisher did not start")
        if self._error is not None:
            raise RuntimeError(f"kv events: {self._error}")

    def publish(self, cache_events: list[CacheStored | CacheRemoved] | list[int],
                medium: str = MEDIUM) -> None:
        """Queue one step's events (the caller gives the list up), or the block hashes removed
        from `medium`; nothing once the publisher's thread has failed (it logged why)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put_nowait((time.time(), cache_events, medium))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("kv events: the queue is full (%d batches): batches are dropped",
                            self.config.max_queue_size)

    def shutdown(self) -> None:
        with contextlib.suppress(queue.Full):  # a full queue: the thread's `_stop` still ends it
            self._queue.put_nowait(None)
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        ctx = zmq.Context()
        sockets: list[zmq.Socket] = []
        try:
            pub = ctx.socket(zmq.PUB)
            sockets.append(pub)
            pub.set_hwm(self.config.hwm)
            pub.bind(self.config.endpoint)
            replay = None
            if self.config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = f"cannot bind {self.config.endpoint} / {self.config.replay_endpoint}: {e}"
            self._started.set()
            self._close(ctx, sockets)
            return
        self._started.set()
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)

        def send(ts: float, events: list[KVCacheEvent]) -> None:
            seq = buffer[-1][0] + 1 if buffer else 0
            payload = self._encoder.encode(KVEventBatch(ts, events))
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            buffer.append((seq, payload))

        try:
            send(time.time(), [AllBlocksCleared()])
            while not self._stop.is_set():
                if replay is not None:
                    while replay.poll(0):
                        self._replay(replay, topic, buffer)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                ts, cache_events, medium = item
                send(ts, to_events(cache_events, self.page_size, medium))
        except Exception:  # noqa: BLE001 - the engine serves on without events; say why
            log.exception("kv events: the publisher failed; no more events are sent")
        finally:
            self._close(ctx, sockets)

    @staticmethod
    def _close(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()

    @staticmethod
    def _replay(sock: zmq.Socket, topic: bytes, buffer: deque[tuple[int, bytes]]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a malformed replay request (%d frames) is ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in buffer:
            if seq >= start:
                sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", b"", REPLAY_END, b""))
