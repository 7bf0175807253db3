"""Constrained requests wait here while their grammar compiles, outside the engine's steps.

A grammar can take seconds to compile; compiling it inside the loop would stall every running
request for as long. Every rank starts the compile (`GrammarBook.compile_async`, a thread) when the
request arrives and keeps the request out of its engine; when rank 0's compile has finished, rank 0
sends `Admit` with the next inputs, so that every rank adds the request at the same step (a rank
whose own compile is behind waits for it there). A compile that fails is the request's error then.
"""

from __future__ import annotations

from concurrent.futures import Future

from compiled_engine.kv_tier.tier import HostPages
from compiled_engine.ranks.messages import Add


class GrammarWait:
    def __init__(self, grammars) -> None:
        """`grammars`: the engine's GrammarBook (None: the engine serves no constraints, and its
        add_request refuses them)."""
        self._grammars = grammars
        self._waiting: dict[str, tuple[Add, Future, HostPages | None]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, msg: Add, host: HostPages | None = None) -> bool:
        """Keep `msg` (and its prompt's pages read from the KV tier) here, its grammar compiling,
        if it has a constraint; False: add it now."""
        spec = msg.params.structured
        if spec is None or self._grammars is None:
            return False
        self._waiting[msg.rid] = (msg, self._grammars.compile_async(spec), host)
        return True

    def ready(self) -> tuple[str, ...]:
        """The requests whose compile has finished here, in arrival order (rank 0 admits them)."""
        return tuple(rid for rid, (_, future, _) in self._waiting.items() if future.done())

    def admit(self, rids: tuple[str, ...]) -> list[tuple[Add, Future, HostPages | None]]:
        """Take `rids` out (those still here: one aborted meanwhile is gone), each with its
        compile (done once this rank's own compile is: `result()` waits for it) and its pages."""
        return [self._waiting.pop(rid) for rid in rids if rid in self._waiting]

    def drop(self, rid: str) -> bool:
        """Forget an aborted or finished request; False if it was not here."""
        return self._waiting.pop(rid, None) is not None
