"""The process entry of a launcher-spawned rank, importable without torch: the launcher (in the
server's process, which never imports torch) pickles `run_rank` by reference, and the rank imports
the engine itself."""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from compiled_engine.ranks.orphan_watch import exit_with_parent
from compiled_engine.ranks.rank_spec import RankSpec


def run_rank(spec: RankSpec, conn: Connection | None) -> None:
    """Process entry point of a launcher-spawned rank. `conn` is the launcher's channel on rank
    0."""
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C goes to the server, which stops the ranks in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    from compiled_engine.ranks.rank_loop import serve_rank

    serve_rank(spec, conn)
