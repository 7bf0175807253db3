"""Starting the engine rank processes (spawn), waiting until rank 0 is ready, and stopping them."""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

from compiled_engine.config import EngineConfig
from compiled_engine.distributed.rank_loop import Fatal, RankSpec, Ready, Shutdown, run_rank


class EngineStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineHandle:
    """The running ranks: `conn` is the private channel to rank 0 (inputs in, event lists out)."""

    conn: Connection
    procs: list[BaseProcess]
    ready: Ready

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        _stop(self.conn, self.procs, timeout_s)


def launch(config: EngineConfig, ready_timeout_s: float = 900.0) -> EngineHandle:
    """Spawn `config.tp_size` ranks and return once rank 0 reports Ready (EngineStartError otherwise)."""
    ctx = mp.get_context("spawn")
    world = config.tp_size
    port = free_port() if world > 1 else 0
    server_end, rank_end = ctx.Pipe(duplex=True)
    procs: list[BaseProcess] = []
    for rank in range(world):
        conn = rank_end if rank == 0 else None
        p = ctx.Process(target=run_rank, args=(RankSpec(rank, world, port, config), conn),
                        name=f"engine-rank-{rank}")
        p.start()
        procs.append(p)
    rank_end.close()
    try:
        ready = _wait_ready(server_end, procs, ready_timeout_s)
    except BaseException:
        _stop(server_end, procs, timeout_s=2.0)
        raise
    return EngineHandle(server_end, procs, ready)


def _wait_ready(conn: Connection, procs: list[BaseProcess], timeout_s: float) -> Ready:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                events = conn.recv()
            except EOFError:
                raise EngineStartError("engine rank 0 exited during start-up (see its log above)") from None
            for ev in events:
                if isinstance(ev, Ready):
                    return ev
                if isinstance(ev, Fatal):
                    raise EngineStartError(ev.message)
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise EngineStartError(f"{dead[0].name} exited with code {dead[0].exitcode} during start-up")
    raise EngineStartError(f"the engine did not start within {timeout_s:.0f}s")


def _stop(conn: Connection, procs: list[BaseProcess], timeout_s: float) -> None:
    """Ask rank 0 to stop (it forwards the stop to every rank), join, then terminate and kill leftovers."""
    with contextlib.suppress(OSError, ValueError):
        conn.send(Shutdown())
    _join_all(procs, timeout_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
    _join_all(procs, 3.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(3.0)
    with contextlib.suppress(OSError):
        conn.close()


def _join_all(procs: list[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
