"""The main loop of one engine rank process.

Rank 0 drains its private channel (a `multiprocessing` Connection from the launcher), forwards every
input to all ranks in the same order (one `broadcast_object_list` per iteration over the gloo
control group), so each rank's scheduler consumes the same inputs at the same step, then every rank
applies the inputs and steps. A constrained request waits outside the engine until its grammar
has compiled (grammar_wait.py), and a LoRA adapter is served once every rank has read its file
(adapter_wait.py); a request whose prompt's pages the KV tier has waits while every rank reads
them (tier_wait.py). Rank 0 sends each step's events back over the channel as one list.
Each iteration stamps the rank's heartbeat (the launcher's hang detection) and, in TP debug mode,
checks that every rank planned and sampled the same (see digest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection

import torch

import kernels
from compiled_engine.config import EngineConfig
from compiled_engine.constraints import ConstraintError
from compiled_engine.layers.moe import expert_load
from compiled_engine.ranks.adapter_wait import AdapterWait
from compiled_engine.ranks.digest import compare_across_ranks, debug_enabled, ledger_digest
from compiled_engine.ranks.grammar_wait import GrammarWait
from compiled_engine.ranks.messages import (
    Abort,
    AdaptersRead,
    Add,
    Admit,
    Fatal,
    Finish,
    LoadLora,
    LoraReply,
    Ready,
    RequestError,
    Shutdown,
    StatsReply,
    StatsRequest,
    TierRead,
    UnloadLora,
)
from compiled_engine.ranks.rank_spec import RankSpec
from compiled_engine.ranks.tier_wait import TierWait

log = logging.getLogger(__name__)

# rank 0's longest wait on the channel when idle (so also the idle heartbeat period)
IDLE_POLL_S = 0.5
# rank 0's wait on the channel when idle but for requests whose grammar compiles
GRAMMAR_POLL_S = 0.005
# A collective waiting this long fails (start-up skew between ranks must fit; the launcher's monitor
# detects hangs sooner, from heartbeats: EngineConfig.rank_timeout_s).
MIN_COLLECTIVE_TIMEOUT_S = 600.0


def serve_rank(spec: RankSpec, conn: Connection | None) -> None:
    """Join the TP world, build the engine, run the loop until Shutdown. Failures are reported on
    `conn` (rank 0) and end the process with exit code 1: a ValueError or OSError before Ready
    (a checkpoint or flag the engine cannot start with) as a refusal, its traceback logged at
    debug level only (rank 0's launcher reports it)."""
    started = False
    try:
        kernels.apply_isa_caps()  # before the process group's first tensor
        config, control = _init_distributed(spec)
        from compiled_engine.models.loader import weight_bytes
        from compiled_engine.runner.kv_cache import kv_pool_bytes
        from compiled_engine.startup import build_engine

        engine = build_engine(config)
        summaries = _gather_strings(engine.compile_summary, control)
        if conn is not None:
            sched = engine.scheduler.config
            conn.send(
                [
                    Ready(
                        sched.max_context,
                        sched.capacity_tokens,
                        sched.num_pages,
                        sched.eos_token_ids,
                        sched.vocab_size,
                        summaries,
                        weight_bytes(engine.model),
                        kv_pool_bytes(engine.runner),
                        engine.model.hidden_size,
                    )
                ]
            )
        started = True
        _loop(spec, engine, conn, control, debug_enabled(config.tp_debug) and control is not None)
        engine.shutdown()
    except BaseException as e:  # noqa: BLE001 - every failure is reported before the process exits
        detail = traceback.format_exc()
        refusal = not started and isinstance(e, ValueError | OSError)
        if not refusal:
            log.error("rank %d failed:\n%s", spec.rank, detail)
        else:
            log.log(logging.DEBUG if conn is not None else logging.ERROR, "rank %d: %s",
                    spec.rank, e)
            log.debug("%s", detail)
        if conn is not None:
            message = (str(e) if refusal
                       else f"engine rank {spec.rank} failed: {type(e).__name__}: {e}")
            with contextlib.suppress(OSError):
                conn.send([Fatal(message, refusal, detail)])
        raise SystemExit(1) from None
    finally:
        if spec.world_size > 1:
            from compiled_engine.parallel.process_group import destroy_distributed

            destroy_distributed()


def _gather_strings(text: str, control) -> tuple[str, ...]:
    """Every rank's `text`, in rank order (over the control group; just ours with one rank)."""
    if control is None:
        return (text,)
    import torch.distributed as dist

    out: list[str | None] = [None] * dist.get_world_size(control)
    dist.all_gather_object(out, text, group=control)
    return tuple(str(t) for t in out)


def _init_distributed(spec: RankSpec) -> tuple[EngineConfig, object | None]:
    """The rank's config (its own CUDA device) and the control group (None with one rank)."""
    from compiled_engine.startup import resolve_device

    config = spec.config
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", spec.rank if spec.local_rank is None else spec.local_rank)
        config = dataclasses.replace(config, device=str(device))
    if spec.world_size == 1:
        return config, None
    from compiled_engine.parallel.process_group import init_distributed

    timeout_s = max(config.rank_timeout_s, MIN_COLLECTIVE_TIMEOUT_S)
    control = init_distributed(spec.rank, spec.world_size, spec.init_method, device, timeout_s,
                               spec.local_world_size or spec.world_size)
    return config, control


def _loop(spec: RankSpec, engine, conn: Connection | None, control, debug: bool) -> None:
    waits = Waits(GrammarWait(engine.features.grammars), AdapterWait(engine), TierWait(engine))
    try:
        _iterate(spec, engine, conn, control, debug, waits)
    finally:
        waits.adapters.close()
        waits.tiers.close()


@dataclasses.dataclass(slots=True)
class Waits:
    """What waits outside the engine's steps: constrained requests for their grammar, adapters
    for their files, requests for their prompt's pages from the KV tier."""

    grammars: GrammarWait
    adapters: AdapterWait
    tiers: TierWait

    def __bool__(self) -> bool:
        return bool(len(self.grammars) or len(self.adapters) or len(self.tiers))


def _iterate(spec: RankSpec, engine, conn: Connection | None, control, debug: bool,
             waits: Waits) -> None:
    engine.keep_last_plan = debug
    while True:
        if spec.heartbeats is not None:
            spec.heartbeats[spec.rank] = time.monotonic()
        inputs, local = _receive(engine, conn, waits, control)
        events: list = []
        stop = False
        for msg in inputs:
            if isinstance(msg, Shutdown):
                stop = True
            else:
                _apply(engine, waits, control, msg, events)
        if stop:
            return
        stepped = engine.has_work()
        if stepped:
            events.extend(engine.step())
        if debug:
            plan = engine.last_plan if stepped else None
            compare_across_ranks(engine.steps, ledger_digest(engine.steps, plan, events), control)
        for req in local:
            events.append(_stats(engine, waits, req))
        if conn is not None and events:
            conn.send(events)


def _receive(engine, conn: Connection | None, waits: Waits, control
             ) -> tuple[list, list[StatsRequest]]:
    """Rank 0: this iteration's inputs from the channel (a request's prompt pages in the KV tier
    named), then the requests whose grammar has compiled or whose pages were read, and the adapters
    read. Every rank: the same list, in the same order."""
    inputs: list = []
    local: list[StatsRequest] = []
    if conn is not None:
        timeout = 0.0 if engine.has_work() else GRAMMAR_POLL_S if waits else IDLE_POLL_S
        while conn.poll(timeout):
            for msg in _as_list(conn.recv()):
                if isinstance(msg, Add) and engine.tier is not None:
                    msg.tier_span = _tier_span(engine, waits.tiers, msg)
                (local if isinstance(msg, StatsRequest) else inputs).append(msg)
            timeout = 0.0
        for ready, message in ((waits.tiers.ready(), TierRead), (waits.grammars.ready(), Admit)):
            if ready:
                inputs.append(message(ready))
        read, late = waits.adapters.ready()
        if read or late:
            inputs.append(AdaptersRead(read, late))
    if control is not None:
        import torch.distributed as dist

        box = [inputs]
        dist.broadcast_object_list(box, src=0, group=control)
        inputs = box[0]
    return inputs, local


def _tier_span(engine, tiers: TierWait, msg: Add) -> tuple[int, int] | None:
    """Rank 0: the prompt pages of `msg` that every rank reads from its KV tier while it waits
    (None: it is prefilled; a request that computes every position has no use for them)."""
    if msg.params.ledger_params().every_position:
        return None
    span = engine.tier_span(msg.prompt_ids, msg.lora_name, msg.params.cache_salt)
    return span if span is not None and tiers.room(span) else None


def _as_list(received: object) -> list:
    """A client may send several inputs as one list: they then reach the same step together."""
    return received if isinstance(received, list) else [received]


def _apply(engine, waits: Waits, control, msg: object, events: list) -> None:
    if isinstance(msg, Add):
        if not waits.tiers.hold(msg) and not waits.grammars.hold(msg):
            _add(engine, msg, events)
    elif isinstance(msg, TierRead):
        for add, host in waits.tiers.admit(msg.rids, control):
            if not waits.grammars.hold(add, host):
                _add(engine, add, events, host=host)
    elif isinstance(msg, Admit):
        for add, compile_, host in waits.grammars.admit(msg.rids):
            try:
                compiled = compile_.result()
            except ConstraintError as e:  # a bad constraint: that request's error only
                events.append(_request_error(add.rid, e))
                continue
            _add(engine, add, events, compiled, host)
    elif isinstance(msg, Abort):
        if not waits.grammars.drop(msg.rid) and not waits.tiers.drop(msg.rid):
            engine.abort(msg.rid)
    elif isinstance(msg, Finish):
        if not waits.grammars.drop(msg.rid) and not waits.tiers.drop(msg.rid):
            engine.finish(msg.rid, msg.reason)
    elif isinstance(msg, LoadLora):
        waits.adapters.start(msg)
    elif isinstance(msg, AdaptersRead):
        events.extend(waits.adapters.serve(msg.tokens, msg.late, control))
    elif isinstance(msg, UnloadLora):
        events.append(_unload(engine, msg))
    else:
        raise TypeError(f"unknown engine input {msg!r}")


def _unload(engine, msg: UnloadLora) -> LoraReply:
    """Unload an adapter on this rank (each rank does, in the same step)."""
    try:
        if not engine.remove_lora(msg.name):
            return LoraReply(msg.token, f"the LoRA adapter '{msg.name}' is in use by running "
                             "requests: unload it once they finish", 400)
    except KeyError:
        return LoraReply(msg.token, f"The lora adapter '{msg.name}' cannot be found.", 404)
    return LoraReply(msg.token)


def _add(engine, msg: Add, events: list, compiled_grammar=None, host=None) -> None:
    try:
        engine.add_request(msg.rid, msg.prompt_ids, msg.params, compiled_grammar, msg.lora_name,
                           host)
    # RequestRejected, bad parameters, a bad constraint: answer that request only
    except ValueError as e:
        events.append(_request_error(msg.rid, e))


def _request_error(rid: str, error: ValueError) -> RequestError:
    field = "structured" if isinstance(error, ConstraintError) else None
    return RequestError(rid, str(error), field)


def _stats(engine, waits: Waits, req: StatsRequest) -> StatsReply:
    sched = engine.scheduler
    own = sched.stats()
    stats = asdict(own) | {
        "total_pages": sched.allocator.total,
        "idle": not engine.has_work() and not waits,
        # waiting for its grammar (vLLM's WAITING_FOR_FSM too) or its KV pages is waiting
        "num_waiting": own.num_waiting + len(waits.grammars) + len(waits.tiers),
        "num_waiting_grammar": len(waits.grammars),
        "steps": engine.steps,
        "expert_tokens": expert_load(engine.model),
    }
    error = None
    if req.check_integrity:
        try:
            sched.check_integrity()
        except AssertionError as e:
            error = str(e) or "integrity check failed"
    return StatsReply(req.token, stats, error)
