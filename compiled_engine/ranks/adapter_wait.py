"""LoRA adapters being read, outside the engine's steps.

Reading an adapter's file can take a while (bounded by the model's largest adapter: the registry
refuses a larger file unread); reading it inside the loop would stall every running request for as
long. Every rank starts the read (a thread) when `LoadLora` arrives; when rank 0's read has
finished, rank 0 sends `AdaptersRead` with the next inputs, and every rank then serves the adapter
at the same step (a rank whose own read is behind waits for it there). With several ranks they
agree first: one rank's failure (its disk) is every rank's, so that all serve the same adapters.
A load rank 0 has not read within `READ_DEADLINE_S` of its arrival is refused by every rank (the
server stops waiting for the answer after that: what it says then stays true).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from compiled_engine.lora.folder import OUTSIDE, still_confined
from compiled_engine.lora.weights import AdapterError, AdapterWeights
from compiled_engine.ranks.messages import LoadLora, LoraReply

READ_DEADLINE_S = 90.0  # less than the server's wait for the answer (server/lora_routes.py)


class AdapterWait:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._reads: dict[int, tuple[LoadLora, Future, float]] = {}  # token -> its read, start
        self._pool: ThreadPoolExecutor | None = None  # one thread: reads queue behind each other

    def __len__(self) -> int:
        return len(self._reads)

    def start(self, msg: LoadLora) -> None:
        """Begin reading `msg`'s adapter on a thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        read = self._pool.submit(self._read, msg)
        self._reads[msg.token] = (msg, read, time.monotonic())

    def _read(self, msg: LoadLora) -> AdapterWeights:
        """The adapter's weights; a client's path that no longer resolves to itself inside its
        folder, or whose files do not (a link put in its way or in a file's place since the server
        checked it), refused unread."""
        if msg.root is not None and not still_confined(msg.root, msg.path):
            raise AdapterError(OUTSIDE)
        return self._engine.read_lora(msg.name, msg.path)

    def ready(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rank 0: the loads read here, and those past the deadline, in arrival order."""
        now = time.monotonic()
        late = tuple(t for t, (_, _, start) in self._reads.items() if now - start > READ_DEADLINE_S)
        read = tuple(t for t, (_, future, _) in self._reads.items()
                     if future.done() and t not in late)
        return read, late

    def serve(self, tokens: tuple[int, ...], late: tuple[int, ...], control) -> list[LoraReply]:
        """Serve the adapters of `tokens` (each rank waits for its own read), or answer why not;
        refuse those of `late`."""
        replies = []
        for token in late:
            msg, _, _ = self._reads.pop(token)
            replies.append(LoraReply(token, f"reading the adapter at {msg.path[:200]!r} took "
                                     f"longer than {READ_DEADLINE_S:.0f} s: it is not loaded", 503))
        for token in tokens:
            msg, future, _ = self._reads.pop(token)
            try:
                weights, error = future.result(), None
            except ValueError as e:  # AdapterError: nothing changed
                weights, error = None, str(e)
            except Exception as e:  # noqa: BLE001 - whatever a file does to a reader: a 400
                weights, error = None, (f"cannot read the adapter at {msg.path[:200]!r}: "
                                        f"{type(e).__name__}: {str(e)[:300]}")
            error = _agreed(error, control)
            if error is None:
                try:
                    self._engine.serve_lora(msg.name, msg.path, weights)
                except ValueError as e:  # the name was taken, or the cap reached, meanwhile
                    error = str(e)
            replies.append(LoraReply(token, error, 200 if error is None else 400))
        return replies

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _agreed(error: str | None, control) -> str | None:
    """The first rank's error (in rank order) if any rank had one; ours with a single rank."""
    if control is None:
        return error
    import torch.distributed as dist

    errors: list[str | None] = [None] * dist.get_world_size(control)
    dist.all_gather_object(errors, error, group=control)
    return next((e for e in errors if e is not None), None)
