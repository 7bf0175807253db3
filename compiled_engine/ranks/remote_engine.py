"""The TP engine (ranks spawned by the launcher) driven synchronously through rank 0's channel, with
the calls `LLM` makes on an in-process `Engine`: add_request, abort, finish, has_work, step,
shutdown, and the LoRA adapters' add_lora, remove_lora, lora_paths."""

from __future__ import annotations

import itertools
from dataclasses import fields

from compiled_engine.config import EngineConfig
from compiled_engine.lora.weights import AdapterError
from compiled_engine.ranks.launcher import EngineFailure, launch
from compiled_engine.ranks.messages import (
    Abort,
    Add,
    Fatal,
    Finish,
    LoadLora,
    LoraReply,
    RequestError,
    StatsReply,
    StatsRequest,
    UnloadLora,
)
from compiled_engine.request_state import check_sampling
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.plan import TokenEvent
from compiled_engine.scheduler.scheduler import SchedulerStats
from compiled_engine.scheduler.validation import check_request


class RemoteEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.handle = launch(config)
        self.eos_token_ids = self.handle.ready.eos_token_ids
        self.scheduler = _RemoteScheduler(self)
        self._live: dict[str, None] = {}  # requests added and not yet finished, aborted or rejected
        # inputs sent as one message before the next receive: they share a step
        self._outbox: list = []
        self._backlog: list = []  # events received while waiting for a stats reply
        self._tokens = itertools.count()
        self._closed = False
        self._adapters = dict(config.lora_modules)  # the LoRA adapters served: name -> path
        self._policy = config.scheduling_policy

    def read_tier(self, prompt_ids: list[int], lora_name: str | None = None,
                  cache_salt: str | None = None) -> None:
        """None: the ranks read their KV tiers themselves (`ranks.tier_wait`)."""
        return None

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None, host: None = None) -> None:
        """Checks what the engine would reject at once (ValueError), then queues the request on rank
        0."""
        ready = self.handle.ready
        if any(not isinstance(f, str) for f in params.logits_processors):
            raise ValueError(
                f"request {rid!r}: at tp_size > 1 a logits processor is given by name, "
                "'package.module:function' (each rank imports it): a function cannot be sent to "
                "the ranks"
            )
        check_sampling(rid, params)
        check_request(
            rid,
            prompt_ids,
            params.ledger_params(),
            ready.max_context,
            ready.capacity_tokens,
            ready.vocab_size,
            policy=self._policy,
        )
        if lora_name is not None and lora_name not in self._adapters:
            raise ValueError(f"request {rid!r}: no LoRA adapter named {lora_name!r} is loaded")
        self._outbox.append(Add(rid, list(prompt_ids), params, lora_name))
        self._live[rid] = None

    def abort(self, rid: str) -> None:
        if rid in self._live:
            del self._live[rid]
            self._outbox.append(Abort(rid))

    def finish(self, rid: str, reason: str = "stop") -> None:
        if rid in self._live:
            del self._live[rid]
            self._outbox.append(Finish(rid, reason))

    def has_work(self) -> bool:
        return bool(self._live)

    def step(self) -> list[TokenEvent]:
        """The next events of live requests (blocks until there are some, or nothing is live). A
        request the engine rejected (a constraint it cannot compile) raises ValueError, after the
        events that came before the rejection were returned; the events after it wait for the next
        call."""
        while self._live:
            received = self._backlog or self._recv()
            self._backlog = []
            out: list[TokenEvent] = []
            for i, ev in enumerate(received):
                if isinstance(ev, RequestError) and ev.rid in self._live:
                    if out:  # delivered first: the rejection is raised by the next call
                        self._backlog = received[i:]
                        return out
                    del self._live[ev.rid]
                    self._backlog = received[i + 1:]
                    raise ValueError(ev.message)
                if self._accept(ev):
                    out.append(ev)
            if out:
                return out
        return []

    def stats(self) -> dict:
        token = next(self._tokens)
        return self._call(StatsRequest(token), token).stats

    def add_lora(self, name: str, path: str) -> None:
        """Every rank serves the adapter at `path` as `name` (AdapterError: nothing changed)."""
        reply = self._call(LoadLora(token := next(self._tokens), name, path), token)
        if reply.error is not None:
            raise AdapterError(reply.error)
        self._adapters[name] = str(path)

    def remove_lora(self, name: str) -> bool:
        """As `Engine.remove_lora`: False while a request uses it, KeyError for no such name."""
        reply = self._call(UnloadLora(token := next(self._tokens), name), token)
        if reply.status == 404:
            raise KeyError(name)
        if reply.error is None:
            del self._adapters[name]
        return reply.error is None

    def lora_paths(self) -> dict[str, str]:
        return dict(self._adapters)

    def _call(self, msg: object, token: int) -> StatsReply | LoraReply:
        """Send `msg` and wait for rank 0's reply with `token`; other events wait for `step`."""
        self._outbox.append(msg)
        while True:
            events = self._recv()
            reply = next((ev for ev in events if isinstance(ev, StatsReply | LoraReply)
                          and ev.token == token), None)
            self._backlog.extend(ev for ev in events if ev is not reply)
            if reply is not None:
                return reply

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.handle.shutdown()

    def _accept(self, ev: object) -> bool:
        if isinstance(ev, Fatal):
            raise EngineFailure(self.handle.explain(ev.message))
        if not isinstance(ev, TokenEvent) or ev.rid not in self._live:
            return False  # a late event of a request that was finished or aborted here
        if ev.finished:
            del self._live[ev.rid]
        return True

    def _recv(self) -> list:
        if self._closed:
            raise EngineFailure("the engine was shut down")
        if self._outbox:
            self.handle.send(self._outbox)
            self._outbox = []
        return self.handle.recv()


class _RemoteScheduler:
    """`engine.scheduler.stats()` for callers written against the in-process engine (bench)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def stats(self) -> SchedulerStats:
        stats = self._engine.stats()
        return SchedulerStats(**{f.name: stats[f.name] for f in fields(SchedulerStats)})
