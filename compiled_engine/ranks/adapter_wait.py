"""LoRA adapters being read, outside the engine's steps.

Reading an adapter's file can take a while (bounded by the model's largest adapter: the registry
refuses a larger file unread); reading it inside the loop would stall every running request for as
long. Every rank starts the read (a thread) when `LoadLora` arrives; when rank 0's read has
finished, rank 0 sends `AdaptersRead` with the next inputs, and every rank then serves the adapter
at the same step (a rank whose own read is behind waits for it there). With several ranks they
agree first: one rank's failure (its disk) is every rank's, so that all serve the same adapters.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from compiled_engine.ranks.messages import LoadLora, LoraReply


class AdapterWait:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._reads: dict[int, tuple[LoadLora, Future]] = {}
        self._pool: ThreadPoolExecutor | None = None  # one thread: reads queue behind each other

    def __len__(self) -> int:
        return len(self._reads)

    def start(self, msg: LoadLora) -> None:
        """Begin reading `msg`'s adapter on a thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        read = self._pool.submit(self._engine.read_lora, msg.name, msg.path)
        self._reads[msg.token] = (msg, read)

    def ready(self) -> tuple[int, ...]:
        """The loads whose read has finished here, in arrival order (rank 0 sends them on)."""
        return tuple(token for token, (_, future) in self._reads.items() if future.done())

    def serve(self, tokens: tuple[int, ...], control) -> list[LoraReply]:
        """Serve the adapters of `tokens` (each rank waits for its own read), or answer why not."""
        replies = []
        for token in tokens:
            msg, future = self._reads.pop(token)
            try:
                weights, error = future.result(), None
            except ValueError as e:  # AdapterError: nothing changed
                weights, error = None, str(e)
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
