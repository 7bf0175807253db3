"""The main loop of one engine rank process.

Rank 0 drains its private channel (a `multiprocessing` Connection from the launcher), forwards every
input to all ranks in the same order (one `broadcast_object_list` per iteration over the gloo group), so
each rank's scheduler consumes the same inputs at the same step, then every rank applies the inputs and
steps. Rank 0 sends each step's events back over the channel as one list.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from compiled_engine.config import EngineConfig
from compiled_engine.scheduler.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # rank 0's longest wait on the channel when idle (also the TP heartbeat period)
_control_group = None  # the gloo group that carries rank 0's inputs to every rank (TP only)


# ---- server -> rank 0 ----------------------------------------------------------------------------
@dataclass(slots=True)
class Add:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Abort:
    rid: str


@dataclass(slots=True)
class Finish:
    rid: str
    reason: str = "stop"


@dataclass(slots=True)
class StatsRequest:
    """Answered by rank 0 alone (read-only): a ping, metrics and the ledger's integrity."""

    token: int


@dataclass(slots=True)
class Shutdown:
    pass


# ---- rank 0 -> server ----------------------------------------------------------------------------
@dataclass(slots=True)
class Ready:
    max_context: int
    capacity_tokens: int
    num_pages: int
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class RequestError:
    rid: str
    message: str


@dataclass(slots=True)
class StatsReply:
    token: int
    stats: dict  # SchedulerStats fields + total_pages, idle, steps
    integrity_error: str | None


@dataclass(slots=True)
class Fatal:
    message: str


@dataclass(slots=True)
class RankSpec:
    rank: int
    world_size: int
    port: int
    config: EngineConfig


def run_rank(spec: RankSpec, conn: Connection | None) -> None:
    """Process entry point. `conn` is the launcher's channel on rank 0, None elsewhere."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops the ranks in order
    try:
        _init_distributed(spec)
        from compiled_engine.startup import build_engine

        engine = build_engine(spec.config)
        if conn is not None:
            sched = engine.scheduler.config
            conn.send([Ready(sched.max_context, sched.capacity_tokens, sched.num_pages, engine.eos_token_ids)])
        _loop(spec, engine, conn)
        engine.shutdown()
    except BaseException as e:  # noqa: BLE001 - every failure is reported before the process exits
        log.error("rank %d failed:\n%s", spec.rank, traceback.format_exc())
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send([Fatal(f"engine rank {spec.rank} failed: {type(e).__name__}: {e}")])
        raise SystemExit(1) from None
    finally:
        _destroy_distributed(spec)


def _init_distributed(spec: RankSpec) -> None:
    if spec.world_size == 1:
        return
    import torch
    import torch.distributed as dist

    from compiled_engine.distributed.parallel_state import init_tensor_parallel

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))  # ranks share the host's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=spec.rank,
                            world_size=spec.world_size, timeout=timedelta(hours=24))
    init_tensor_parallel()
    # The input fan-out gets its own group: with overlap the forward's collectives run in a worker thread,
    # and two threads interleaving ops on one group would pair them differently on different ranks.
    global _control_group
    _control_group = dist.new_group(backend="gloo", timeout=timedelta(hours=24))


def _destroy_distributed(spec: RankSpec) -> None:
    if spec.world_size == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _loop(spec: RankSpec, engine, conn: Connection | None) -> None:
    while True:
        inputs, local = _receive(spec, conn, busy=engine.has_work())
        events: list = []
        stop = False
        for msg in inputs:
            if isinstance(msg, Shutdown):
                stop = True
            else:
                _apply(engine, msg, events)
        if stop:
            return
        if engine.has_work():
            events.extend(engine.step())
        for req in local:
            events.append(_stats(engine, req))
        if conn is not None and events:
            conn.send(events)


def _receive(spec: RankSpec, conn: Connection | None, busy: bool) -> tuple[list, list[StatsRequest]]:
    """Rank 0: this iteration's inputs from the channel. Every rank: the same list, in the same order."""
    inputs: list = []
    local: list[StatsRequest] = []
    if conn is not None:
        timeout = 0.0 if busy else IDLE_POLL_S
        while conn.poll(timeout):
            msg = conn.recv()
            (local if isinstance(msg, StatsRequest) else inputs).append(msg)
            timeout = 0.0
    if spec.world_size > 1:
        import torch.distributed as dist

        box = [inputs]
        dist.broadcast_object_list(box, src=0, group=_control_group)
        inputs = box[0]
    return inputs, local


def _apply(engine, msg: Add | Abort | Finish, events: list) -> None:
    if isinstance(msg, Add):
        try:
            engine.add_request(msg.rid, msg.prompt_ids, msg.params)
        except ValueError as e:  # RequestRejected and bad parameters: answer that request only
            events.append(RequestError(msg.rid, str(e)))
    elif isinstance(msg, Abort):
        engine.abort(msg.rid)
    elif isinstance(msg, Finish):
        engine.finish(msg.rid, msg.reason)
    else:
        raise TypeError(f"unknown engine input {msg!r}")


def _stats(engine, req: StatsRequest) -> StatsReply:
    sched = engine.scheduler
    stats = asdict(sched.stats()) | {"total_pages": sched.allocator.total, "idle": not engine.has_work(),
                                     "steps": engine.steps}
    try:
        sched.check_integrity()
        error = None
    except AssertionError as e:
        error = str(e) or "integrity check failed"
    return StatsReply(req.token, stats, error)
