"""The wire types between the server (or `RemoteEngine`) and engine rank 0, over the launcher's
channel. A client may send several inputs as one list: they then reach the same engine step
together."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.sampling_params import SamplingParams


# ---- server -> rank 0 ----------------------------------------------------------------------------
@dataclass(slots=True)
class Add:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None  # a loaded LoRA adapter's (None: the base model)
    # the prompt's pages [first, end) that rank 0's KV tier has: every rank reads them while the
    # request waits (`tier_wait`); rank 0 sets it before it forwards the request
    tier_span: tuple[int, int] | None = None


@dataclass(slots=True)
class Abort:
    rid: str


@dataclass(slots=True)
class Finish:
    rid: str
    reason: str = "stop"


@dataclass(slots=True)
class StatsRequest:
    """Answered by rank 0 alone (read-only): a ping and the metrics; with `check_integrity`, the
    ledger's full integrity check too (O(pages): the server's --debug endpoint and tests, never
    /health or /metrics)."""

    token: int
    check_integrity: bool = False


@dataclass(slots=True)
class LoadLora:
    """Every rank reads and checks the adapter at `path` (off its loop), then serves it as `name`;
    rank 0 answers with a `LoraReply`. With `root` (a client's load: `path` is the real path the
    server found inside that folder) each rank checks again that it still is, before reading."""

    token: int
    name: str
    path: str
    root: str | None = None


@dataclass(slots=True)
class UnloadLora:
    """Every rank stops serving adapter `name` (refused while a request uses it)."""

    token: int
    name: str


@dataclass(slots=True)
class Shutdown:
    pass


# ---- rank 0 -> every rank (inside the broadcast of inputs) ---------------------------------------
@dataclass(slots=True)
class Admit:
    """These requests' constraints have compiled (or failed to) on rank 0: every rank now adds
    them, at the same step (`grammar_wait`)."""

    rids: tuple[str, ...]


@dataclass(slots=True)
class TierRead:
    """These requests' prompt pages have been read from the KV tier on rank 0: every rank now adds
    them, at the same step, with the pages every rank has read (`tier_wait`)."""

    rids: tuple[str, ...]


@dataclass(slots=True)
class AdaptersRead:
    """These `LoadLora`s' adapters have been read (or failed to) on rank 0: every rank now serves
    them, at the same step, and refuses the `late` ones (`adapter_wait`)."""

    tokens: tuple[int, ...]
    late: tuple[int, ...] = ()


# ---- rank 0 -> server ----------------------------------------------------------------------------
@dataclass(slots=True)
class Ready:
    max_context: int
    capacity_tokens: int
    num_pages: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    compile_summaries: tuple[str, ...]  # each rank's compile-cache report, in rank order
    weight_bytes: int = 0  # rank 0's weights as held (packed weights as packed)
    kv_pool_bytes: int = 0  # rank 0's KV pool (address space; CPU pages come in as written)
    hidden_size: int = 0  # the model's: the length of its embeddings


@dataclass(slots=True)
class RequestError:
    rid: str
    message: str
    # "structured": the request's constraint did not compile (the server names its field)
    field: str | None = None


@dataclass(slots=True)
class StatsReply:
    token: int
    stats: dict  # SchedulerStats fields + total_pages, idle, steps
    integrity_error: str | None


@dataclass(slots=True)
class LoraReply:
    """The outcome of a `LoadLora` / `UnloadLora`: `error` None when done, else why not, with the
    HTTP status it maps to (400 a bad adapter or one in use, 404 no such adapter)."""

    token: int
    error: str | None = None
    status: int = 200


@dataclass(slots=True)
class Fatal:
    message: str
    refusal: bool = False  # a start-up the configuration rules out (launcher.StartupRefusal)
    detail: str = ""  # the rank's traceback
