"""`--kv-events-config`: vLLM's KVEventsConfig names and defaults, but for the endpoint, which is
bound on loopback by default (vLLM's default binds every interface)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from compiled_engine.config import json_object

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (as vLLM)
    # the PUB socket, always bound (the routers connect to each worker); tcp://*:PORT for every
    # interface
    endpoint: str = "tcp://127.0.0.1:5557"
    # a ROUTER socket answering replay requests from the last `buffer_steps` batches
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread (more are dropped)
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def parse(cls, value: dict | str | None) -> KVEventsConfig | None:
        """From a dict or its JSON text (None: off); ValueError naming the first bad or unknown
        field."""
        value = json_object(value, "kv events config", {f.name for f in fields(cls)})
        if value is None:
            return None
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def check(ok: bool, message: str, got: object) -> None:
            if not ok:
                raise ValueError(f"kv events config: {message}, got {got!r}")

        check(isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events must be a "
              "boolean", self.enable_kv_cache_events)
        check(self.publisher is None or self.publisher in PUBLISHERS,
              f"publisher must be one of {', '.join(PUBLISHERS)}", self.publisher)
        check(isinstance(self.endpoint, str) and "://" in self.endpoint,
              "endpoint must be a ZMQ address such as tcp://127.0.0.1:5557", self.endpoint)
        check(self.replay_endpoint is None
              or (isinstance(self.replay_endpoint, str) and "://" in self.replay_endpoint),
              "replay_endpoint must be a ZMQ address", self.replay_endpoint)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{name} must be a positive integer", value)
        check(isinstance(self.topic, str), "topic must be a string", self.topic)
