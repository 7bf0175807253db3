"""A rank reads an adapter's file on a thread: the adapter is served only once `AdapterWait.serve`
runs for it (the loop steps meanwhile), a failed read (whatever it raised) is that load's 400 and
serves nothing, a name taken while the file was read is refused then, and a read past the deadline
is refused whether or not it finished."""

from __future__ import annotations

import threading

from compiled_engine.lora.weights import AdapterError
from compiled_engine.ranks import adapter_wait
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
        if path == "broken":
            raise KeyError("general.architecture")
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
        wait.start(LoadLora(4, "c", "broken"))
        assert len(wait) == 4 and wait.ready() == ((), ())  # the loop is not held
        engine.release.set()
        for _ in range(3000):
            if len(wait.ready()[0]) == 4:
                break
            threading.Event().wait(0.01)
        assert wait.ready() == ((1, 2, 3, 4), ())
        assert engine.served == {}  # read, not served until rank 0 sends them on
        replies = wait.serve((1, 2, 3, 4), (), control=None)
    finally:
        wait.close()
    assert replies[0] == LoraReply(1)
    assert replies[1] == LoraReply(2, "no adapter at 'bad'", 400)
    assert replies[2] == LoraReply(3, "an adapter named 'a' is already loaded", 400)
    assert replies[3] == LoraReply(
        4, "cannot read the adapter at 'broken': KeyError: 'general.architecture'", 400)
    assert engine.served == {"a": "weights of a.safetensors"} and len(wait) == 0


def test_a_read_past_the_deadline_is_refused_by_every_rank(monkeypatch) -> None:
    engine = SlowEngine()
    wait = AdapterWait(engine)
    monkeypatch.setattr(adapter_wait, "READ_DEADLINE_S", 0.0)
    try:
        wait.start(LoadLora(1, "slow", "a.safetensors"))
        threading.Event().wait(0.01)
        assert wait.ready() == ((), (1,))  # still reading, already late
        replies = wait.serve((), (1,), control=None)
        engine.release.set()
    finally:
        wait.close()
    assert replies == [LoraReply(1, "reading the adapter at 'a.safetensors' took longer than 0 s: "
                                    "it is not loaded", 503)]
    assert engine.served == {} and len(wait) == 0
