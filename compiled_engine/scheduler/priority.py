"""Priority scheduling (vLLM's `--scheduling-policy priority`): a lower `LedgerParams.priority` is
sooner. A request's rank is its priority less one per `aging_steps` steps since it arrived (aging:
a request waiting long enough outranks any newer one, so none starves), then its arrival order.
Waiting requests are admitted by rank; a waiting request that cannot be admitted preempts (retracts)
the running request of the worst rank if it `preempts` it (one per step)."""

from __future__ import annotations

from collections.abc import Iterable

from compiled_engine.scheduler.request import Request


def rank(req: Request, step: int, aging_steps: int) -> tuple[int, int]:
    """The request's place at step `step` (smaller is sooner)."""
    return (req.params.priority - (step - req.arrival_step) // aging_steps, req.arrival)


def worst(reqs: Iterable[Request], step: int, aging_steps: int) -> Request | None:
    """The request of the worst rank."""
    return max(reqs, key=lambda r: rank(r, step, aging_steps), default=None)


def preempts(waiting: Request, running: Request, step: int, aging_steps: int) -> bool:
    """Whether `waiting` may take `running`'s place: a better priority, and a better aged one. The
    first makes preemption a strict order (no two requests preempt each other in turn, which
    aged ranks alone would do as their ages cross step boundaries at different times); the second
    bounds how long a request that aged may be preempted by newer ones."""
    return (waiting.params.priority < running.params.priority
            and rank(waiting, step, aging_steps)[0] < rank(running, step, aging_steps)[0])
