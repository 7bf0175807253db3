"""A rank reads an adapter's file on a thread: the adapter is served only once `AdapterWait.serve`
runs for it (the loop steps meanwhile), a failed read is that load's 400 and serves nothing, and a
name taken while the file was read is refused then."""

from __future__ import annotations

import threading

from compiled_engine.lora.weights import AdapterError
from compiled_engine.ranks.adapter_wait import AdapterWait
from compiled_engine.ranks.messages import LoadLora, LoraReply


class SlowEngine:
    """An engine whose reads wait for `release` (a file on a slow disk)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.served: dict[str, str] = {}

    def read_lora(self, name: str, path: str) -> str:
        assert self.release.wait(30), "the test never released the read"
        if path == "bad":
            raise AdapterError(f"no adapter at {path!r}")
        return f"weights of {path}"

    def serve_lora(self, name: str, path: str, weights: str) -> None:
        if name in self.served:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        self.served[name] = weights


def test_reads_run_off_the_loop_and_are_served_when_sent_on() -> None:
    engine = SlowEngine()
    wait = AdapterWait(engine)
    try:
        wait.start(LoadLora(1, "a", "a.safetensors"))
        wait.start(LoadLora(2, "b", "bad"))
        wait.start(LoadLora(3, "a", "other"))
        assert len(wait) == 3 and wait.ready() == ()  # start returned: the loop is not held
        engine.release.set()
        for _ in range(3000):
            if len(wait.ready()) == 3:
                break
            threading.Event().wait(0.01)
        assert wait.ready() == (1, 2, 3)
        assert engine.served == {}  # read, not served until rank 0 sends them on
        replies = wait.serve((1, 2, 3), control=None)
    finally:
        wait.close()
    assert replies[0] == LoraReply(1)
    assert replies[1] == LoraReply(2, "no adapter at 'bad'", 400)
    assert replies[2] == LoraReply(3, "an adapter named 'a' is already loaded", 400)
    assert engine.served == {"a": "weights of a.safetensors"} and len(wait) == 0
