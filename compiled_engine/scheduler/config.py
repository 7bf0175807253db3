"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.scheduler.speculation import SpecConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_pages: int  # KV pool size in pages, including the reserved dummy page 0
    page_size: int = 1
    max_running: int = 256  # cap on running requests; also the number of table rows
    max_context: int = 4096  # positions per request (table width)
    chunk_budget: int = 8192  # tokens computed per step (decode tokens count in mixed steps)
    mixed: bool = True  # decode and prefill chunks share a step; False: prefill-only or decode-only
    prefix_cache: str = "radix"  # "radix" | "naive"
    eos_token_ids: tuple[int, ...] = ()
    # token ids at or above are rejected at admission (None: unchecked)
    vocab_size: int | None = None
    # a waiting request defers admission one step to reuse this many tokens of a running prefill
    share_wait_tokens: int = 32
    # speculative decoding: decode steps carry draft tokens (None: off)
    speculative: SpecConfig | None = None
    # LoRA: adapter slots on the device, the most distinct adapters running at once (0: no LoRA)
    max_loras: int = 0
    # "fcfs": arrival order; "priority": by `LedgerParams.priority`, aged by one per `aging_steps`
    # steps waited, preempting running requests of a worse rank (scheduler/priority.py)
    policy: str = "fcfs"
    aging_steps: int = 64

    @property
    def max_rows(self) -> int:
        return self.max_running

    @property
    def capacity_tokens(self) -> int:
        """KV slots usable by requests (the dummy page excluded)."""
        return (self.num_pages - 1) * self.page_size

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        if self.chunk_budget < 1:
            raise ValueError(f"chunk_budget must be >= 1, got {self.chunk_budget}")
        if self.share_wait_tokens < 1:
            raise ValueError(f"share_wait_tokens must be >= 1, got {self.share_wait_tokens}")
        if self.speculative is not None:
            self.speculative.validate()
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.aging_steps < 1:
            raise ValueError(f"aging_steps must be >= 1, got {self.aging_steps}")
        if self.prefix_cache not in ("radix", "naive"):
            raise ValueError(f"prefix_cache must be 'radix' or 'naive', got {self.prefix_cache!r}")
