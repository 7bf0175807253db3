"""Where the ledger becomes kernel arguments: a `Batch` plan -> the tensors of one forward.

Token ids and page-table rows live on the device (`DeviceTables`); a plan only says which positions of
which rows to compute, so the token sampled in step k is read by step k+1 without a host round trip.
Decode batches are padded to a bucket with rows that read the dummy slot and write nowhere; extend
batches get one padding request of one token so that no dimension is ever 1 (torch.compile would
specialize on it and recompile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_engine.layers.attention import AttentionMetadata
from compiled_engine.runner.attention_backend import PAGED, AttentionBackend
from compiled_engine.scheduler.plan import Batch


class DeviceTables:
    """Token table and page table `[max_rows + 1, max_context]`; the last row is all zeros (padding)."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device) -> None:
        self.pad_row = max_rows
        self.tokens = torch.zeros(max_rows + 1, max_context, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_rows + 1, max_context, dtype=torch.int32, device=device)
        self.device = device

    def apply_writes(self, batch: Batch) -> None:
        """One scatter per table for all of the plan's writes."""
        for writes, table, dtype in ((batch.slot_writes, self.slots, torch.int32),
                                     (batch.token_writes, self.tokens, torch.long)):
            if not writes:
                continue
            rows: list[int] = []
            cols: list[int] = []
            vals: list[int] = []
            for w in writes:
                values = w.slots if table is self.slots else w.tokens
                rows.extend([w.row] * len(values))
                cols.extend(range(w.start, w.start + len(values)))
                vals.extend(values)
            table.index_put_((self._tensor(rows), self._tensor(cols)), self._tensor(vals, dtype))

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [N'] token index of each sampled request, in plan order, then padding
    num_sampled: int  # the first num_sampled entries of logits_index (and rows of the logits) are real
    rows: torch.Tensor  # [B'] table row of each (padded) request
    sample_rows: list[int]  # table row of each sampled request, in plan order
    sample_next_pos: list[int]  # where each sampled token lands in the token table


def build_step_inputs(batch: Batch, tables: DeviceTables, pad_to: int | None,
                      attention: AttentionBackend = PAGED) -> StepInputs:
    """Tensors for one step. `pad_to`: the decode bucket size (decode batches only)."""
    reqs = batch.reqs
    pad = tables.pad_row
    rows = [r.row for r in reqs]
    lengths = [r.length for r in reqs]
    seq_lens = [r.start + r.length for r in reqs]
    out_slots = [s for r in reqs for s in r.out_slots]
    if batch.is_decode:
        n_pad = (pad_to or len(reqs)) - len(reqs)
        rows += [pad] * n_pad
        positions = [r.start for r in reqs] + [0] * n_pad
        lengths += [1] * n_pad
        seq_lens += [0] * n_pad  # seq_len 0: the kernel reads nothing and returns zeros
        out_slots += [-1] * n_pad
        token_rows = rows
    else:
        # One padding request of one token at position 0 of the padding row (slot 0: the dummy page).
        rows.append(pad)
        lengths.append(1)
        seq_lens.append(1)
        out_slots.append(-1)
        positions = [p for r in reqs for p in range(r.start, r.start + r.length)] + [0]
        token_rows = [r.row for r in reqs for _ in range(r.length)] + [pad]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    # Logits row j is the j-th sampled request's (plan order; any request of a step may skip sampling,
    # a 1-token non-final prefill chunk in a decode-shaped step included). The index is padded with the last
    # token to a fixed width: every (padded) row of a decode step, so that a static graph keeps its shape,
    # and >= 2 in an extend step, so that no dynamic dimension is 1.
    sampled = [i for i, r in enumerate(reqs) if r.sample]
    logits_index = [cu[i + 1] - 1 for i in sampled]
    width = len(rows) if batch.is_decode else max(2, len(logits_index))
    logits_index += [cu[-1] - 1] * (width - len(logits_index))
    device = tables.device
    t = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
    rows_t, pos_t = t(rows), t(positions)
    input_ids = tables.tokens[t(token_rows), pos_t]
    meta = attention.metadata(tables.slots.index_select(0, rows_t), t(out_slots), t(seq_lens, torch.int32),
                              t(cu, torch.int32), batch.is_decode)
    sample_rows = [reqs[i].row for i in sampled]
    sample_next_pos = [seq_lens[i] for i in sampled]
    return StepInputs(input_ids, pos_t, meta, t(logits_index), len(sampled), rows_t, sample_rows, sample_next_pos)
