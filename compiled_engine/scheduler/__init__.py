"""Pure-Python scheduler core (standard library only): the request ledger and the step planner."""

from compiled_engine.scheduler.allocator import IdPool, PageAllocator
from compiled_engine.scheduler.config import SchedulerConfig
from compiled_engine.scheduler.plan import (
    DraftAsk,
    ReqStep,
    SlotWrite,
    StepOutput,
    StepPlan,
    TokenEvent,
    TokenWrite,
)
from compiled_engine.scheduler.prefix_cache import NaiveCache, PrefixCache
from compiled_engine.scheduler.radix_cache import RadixCache
from compiled_engine.scheduler.request import (
    LedgerParams,
    Request,
    RequestHooks,
    Status,
    TokenRejected,
)
from compiled_engine.scheduler.scheduler import Scheduler, SchedulerStats
from compiled_engine.scheduler.speculation import SpecConfig
from compiled_engine.scheduler.validation import RequestRejected

__all__ = [
    "DraftAsk",
    "IdPool",
    "LedgerParams",
    "NaiveCache",
    "PageAllocator",
    "PrefixCache",
    "RadixCache",
    "ReqStep",
    "Request",
    "RequestHooks",
    "RequestRejected",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SlotWrite",
    "SpecConfig",
    "Status",
    "StepOutput",
    "StepPlan",
    "TokenEvent",
    "TokenRejected",
    "TokenWrite",
]
