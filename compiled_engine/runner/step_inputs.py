"""Where the ledger becomes kernel arguments: a `StepPlan` plan -> the tensors of one forward.

Token ids and page-table rows live on the device (`DeviceTables`); a plan only says which positions
of which rows to compute, so the token sampled in step k is read by step k+1 without a host round
trip. Decode batches are padded to a bucket with rows that read the dummy slot and write nowhere;
extend batches get one padding request of one token so that no dimension is ever 1 (torch.compile
would specialize on it and recompile).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compiled_engine.layers.attention import AttentionMetadata
from compiled_engine.runner.attention_metadata import build_metadata
from compiled_engine.runner.prompt_outputs import KeptRows
from compiled_engine.runner.staging import DeviceSlab, Staging
from compiled_engine.scheduler.plan import StepPlan


class DeviceTables:
    """Token table and page table `[max_rows + 1, max_context]`; the last row is all zeros
    (padding)."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device) -> None:
        self.pad_row = max_rows
        self.width = max_context
        self.tokens = torch.zeros(max_rows + 1, max_context, dtype=torch.long, device=device)
        self.page_table = torch.zeros(max_rows + 1, max_context, dtype=torch.int32, device=device)
        self.device = device

    def apply_writes(
        self, plan: StepPlan, staging: Staging, sample_next: list[int] | None = None
    ) -> torch.Tensor:
        """One upload and one scatter per table for all of the plan's writes. `sample_next`: the
        flat table positions the step's sampled tokens go to, uploaded with them; returns them on
        the device."""
        slot_at: list[int] = []
        slot_val: list[int] = []
        token_at: list[int] = []
        token_val: list[int] = []
        for writes, at, vals, table in ((plan.slot_writes, slot_at, slot_val, "slots"),
                                        (plan.token_writes, token_at, token_val, "tokens")):
            for w in writes:
                values = w.slots if table == "slots" else w.tokens
                if not values:
                    continue
                base = self.flat(w.row, w.start)
                self.flat(w.row, w.start + len(values) - 1)  # the run ends inside its row
                at.extend(range(base, base + len(values)))
                vals.extend(values)
        up = staging.upload(
            {
                "slot_at": (slot_at, torch.long),
                "slot_val": (slot_val, torch.int32),
                "token_at": (token_at, torch.long),
                "token_val": (token_val, torch.long),
                "sample_next": (sample_next or [], torch.long),
            }
        ).fields
        if slot_at:
            self.page_table.view(-1).index_copy_(0, up["slot_at"], up["slot_val"])
        if token_at:
            self.tokens.view(-1).index_copy_(0, up["token_at"], up["token_val"])
        return up["sample_next"]

    def history(self, row: int, prompt_len: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device views of a row's prompt tokens and generated tokens."""
        return self.tokens[row, :prompt_len], self.tokens[row, prompt_len:length]

    def flat(self, row: int, position: int) -> int:
        """A table cell's index in the flattened table (a position past the row would land in the
        next row)."""
        if not 0 <= position < self.width:
            raise IndexError(
                f"position {position} is outside the token table's {self.width} columns"
            )
        return row * self.width + position


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [N'] token index of each sampled request, in plan order, then padding
    logits_index: torch.Tensor
    # the first num_sampled entries of logits_index (and rows of the logits) are the sampled
    # tokens', the next num_prompt the kept prompt positions' (`KeptRows.num_logprobs`)
    num_sampled: int
    table_rows: torch.Tensor  # [B'] table row of each (padded) request
    # the device tensors the step's host lists were uploaded into (the fields above)
    staged: DeviceSlab
    num_prompt: int = 0
    token_starts: tuple[int, ...] = ()  # request i's tokens are rows [i] .. [i + 1] of the forward


def uses_lora(plan: StepPlan) -> bool:
    """Whether a request of the step has a LoRA adapter (its graphs then add the adapters')."""
    return any(r.lora_slot >= 0 for r in plan.reqs)


def sample_targets(plan: StepPlan, tables: DeviceTables) -> list[int]:
    """Where each sampled token lands in the (flattened) token table, in plan order: after the
    request's last computed position, or (a verify step) after each verified one."""
    return [
        tables.flat(r.row, r.start + r.length - r.num_sampled + 1 + j)
        for r in plan.reqs
        for j in range(r.num_sampled)
    ]


def build_step_inputs(plan: StepPlan, tables: DeviceTables, pad_to: int | None, staging: Staging,
                      into: StepInputs | None = None, kept: Sequence[KeptRows] = ()) -> StepInputs:
    """Tensors for one step. `pad_to`: the decode bucket size (decode batches only). `into`: a
    captured graph's static inputs, which the step's inputs are then written into (and returned).
    `kept`: prompt positions whose logits the step returns too, after the sampled ones."""
    reqs = plan.reqs
    pad = tables.pad_row
    rows = [r.row for r in reqs]
    lengths = [r.length for r in reqs]
    seq_lens = [r.start + r.length for r in reqs]
    out_slots = [s for r in reqs for s in r.out_slots]
    lora = uses_lora(plan)
    lora_slots: list[int] = []
    if plan.is_decode:
        n_pad = (pad_to or len(reqs)) - len(reqs)
        rows += [pad] * n_pad
        positions = [r.start for r in reqs] + [0] * n_pad
        lengths += [1] * n_pad
        seq_lens += [0] * n_pad  # seq_len 0: the kernel reads nothing and returns zeros
        out_slots += [-1] * n_pad
        token_rows = rows
        if lora:
            lora_slots = [r.lora_slot for r in reqs] + [-1] * n_pad
    else:
        # One padding request of one token at position 0 of the padding row (slot 0: the dummy
        # page).
        rows.append(pad)
        lengths.append(1)
        seq_lens.append(1)
        out_slots.append(-1)
        positions = [p for r in reqs for p in range(r.start, r.start + r.length)] + [0]
        token_rows = [r.row for r in reqs for _ in range(r.length)] + [pad]
        if lora:
            lora_slots = [r.lora_slot for r in reqs for _ in range(r.length)] + [-1]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    # Logits row j is the j-th sampled token's (plan order; any request of a step may skip
    # sampling, a 1-token non-final prefill chunk in a decode-shaped step included). The index is
    # padded with the last token to a fixed width: every (padded) row of a decode step, so that a
    # static graph keeps its shape, and >= 2 in an extend step, so that no dynamic dimension is 1.
    # A verify step samples at each of its positions (its last token's and its drafts').
    logits_index = [
        cu[i + 1] - r.num_sampled + j for i, r in enumerate(reqs) for j in range(r.num_sampled)
    ]
    num_sampled = len(logits_index)
    logits_index += [cu[k.index] + j for k in kept for j in range(k.num_logprobs)]
    num_prompt = len(logits_index) - num_sampled
    width = len(rows) if plan.is_decode else max(2, len(logits_index))
    logits_index += [cu[-1] - 1] * (width - len(logits_index))
    long, i32, width_t = torch.long, torch.int32, tables.width
    fields = {
        "token_at": ([r * width_t + p for r, p in zip(token_rows, positions)], long),
        "positions": (positions, long), "table_rows": (rows, long), "out_slots": (out_slots, long),
        "logits_index": (logits_index, long), "seq_lens": (seq_lens, i32), "cu_q_lens": (cu, i32),
    }
    if lora:
        fields["lora_slots"] = (lora_slots, long)
    staged = staging.upload(fields, None if into is None else into.staged)
    f = staged.fields
    if into is None:
        input_ids = tables.tokens.view(-1).index_select(0, f["token_at"])
        page_rows = tables.page_table.index_select(0, f["table_rows"])
    else:
        input_ids = torch.index_select(tables.tokens.view(-1), 0, f["token_at"], out=into.input_ids)
        page_rows = torch.index_select(
            tables.page_table, 0, f["table_rows"], out=into.meta.page_table
        )
    meta = build_metadata(page_rows, f["out_slots"], f["seq_lens"], f["cu_q_lens"], plan.is_decode,
                          f["lora_slots"] if lora else None)
    return StepInputs(input_ids, f["positions"], meta, f["logits_index"], num_sampled,
                      f["table_rows"], staged, num_prompt, tuple(cu))
