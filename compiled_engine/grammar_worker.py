"""The process that compiles output constraints for the server's check (server/grammar_check.py):
the same compile as the engine's ranks (`GrammarBook`), in a process that can be killed when it runs
past its budget. torch and xgrammar are imported here, never in the server's process.

Once loaded, the worker limits itself (rlimits): its data segment (heap and private mappings) may
grow by `memory_bytes` beyond what the load left, so a constraint whose compile would exhaust the
machine's memory fails in the worker alone (a MemoryError, or the allocator's abort: the worker
dies and the server remembers the constraint); each compile may use `cpu_s` seconds of CPU, a
backstop behind the server's wall-clock budget (SIGXCPU ends the worker)."""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from multiprocessing.connection import Connection

from compiled_engine.sampling_params import StructuredOutput

READY = "ready"
MEMORY_BYTES = 2 * 2**30  # what one compile may allocate beyond the loaded worker
OUT_OF_MEMORY_EXIT = 3  # the worker's exit status after a compile ran out of memory


def serve_compiles(conn: Connection, model_path: str, vocab_size: int,
                   stop_token_ids: Sequence[int], memory_bytes: int = MEMORY_BYTES,
                   cpu_s: float | None = None) -> None:
    """Send READY once loaded and limited, then answer each StructuredOutput received with None (it
    compiles) or the ConstraintError's message; return when the other end closes. A compile out of
    memory exits with OUT_OF_MEMORY_EXIT (what it allocated may not go back to the system)."""
    from compiled_engine.constraints import ConstraintError, GrammarBook
    from compiled_engine.tokenization import load_tokenizer

    book = GrammarBook(lambda: load_tokenizer(model_path), vocab_size, stop_token_ids,
                       cache_bytes=0)
    book.compile(StructuredOutput("regex", "a"))  # the tokenizer and xgrammar, before any budget
    _limit_memory(memory_bytes)
    conn.send(READY)
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        if cpu_s is not None:
            _limit_cpu(cpu_s)
        try:
            book.compile(spec)
            conn.send(None)
        except ConstraintError as e:
            if "bad_alloc" in str(e):  # xgrammar's allocation failed
                os._exit(OUT_OF_MEMORY_EXIT)
            conn.send(str(e))
        except MemoryError:
            os._exit(OUT_OF_MEMORY_EXIT)


def _limit_memory(budget: int) -> None:
    """RLIMIT_DATA at the data segment's size now plus `budget`. Not RLIMIT_AS: the loaded
    libraries reserve address space they never touch (allocator arenas, torch's mappings)."""
    soft = _data_bytes() + budget
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _limit_cpu(seconds: float) -> None:
    """The CPU limit at what the worker has used plus `seconds` (the kernel's limit is over the
    process's life, so it moves with each compile)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _data_bytes() -> int:
    """The process's data segment (VmData: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")
