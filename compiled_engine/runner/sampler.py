"""Sampling on the device, per request within one batch.

Order of logit processing: logit_bias and banned ids, repetition / frequency / presence penalties,
the request's JAX logits processors, then the structured-output token mask (tokens the request's
grammar does not allow next) last, so that no rule brings back a token the grammar excludes (vLLM
masks first, and its processors can undo the mask); logprobs are taken from these processed logits,
then temperature, top-k, top-p, min-p and the draw. A row whose mask allows nothing fails its
request. Greedy rows (temperature 0, or top_k 1) take the argmax. A seeded request draws from its
own generator, reseeded from its seed and the position of the token it draws, so its tokens depend
neither on its batch neighbours nor on how many tokens a step draws for it: a speculative verify
step draws each position's token with the random numbers a plain decode would use there
(`scheduler.speculation`).
Nothing here waits for the device: every per-row setting reaches it through pinned memory
(`to_device`), and every decision that depends on the rows is taken on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from compiled_engine.runner.staging import to_device
from compiled_engine.sampling_params import SamplingParams
from kernels import ops


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None = None  # the request's own generator when it is seeded
    banned_ids: tuple[int, ...] = ()  # e.g. EOS ids while fewer than min_tokens were generated
    # device tensors; needed only for penalties and processors
    prompt_ids: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None
    # structured output: packed int32 bitmask of the allowed next tokens
    token_mask: torch.Tensor | None = None
    # Where prompt_ids / output_ids lie in the token table, (table row, prompt length, sequence
    # length): the runner reads them there when it launches the step.
    history: tuple[int, int, int] | None = None
    position: int = 0  # the sequence position of the token drawn (a seeded row's random numbers)


@dataclass(slots=True)
class SampleOutput:
    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] logprob of the chosen token (when any row asked)
    top_ids: torch.Tensor | None = None  # [N, K] top alternatives, K = max requested
    top_logprobs: torch.Tensor | None = None
    # row -> why it failed: its logits processor, or a mask allowing nothing
    errors: dict[int, str] | None = None


NOTHING_ALLOWED = (
    "structured output: the constraint allows no next token (no token of the vocabulary "
    "continues the output so far)"
)
GREEDY_BELOW_TEMPERATURE = 1e-5  # dividing logits by a tinier temperature overflows to inf


def top_logprobs(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest log-probs and their token ids. Equal log-probs come in token-id order,
    whatever the batch: topk leaves the order of ties (and which of them make the cut)
    unspecified."""
    ordered, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
    return ordered[:, :k], ids[:, :k]


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_BELOW_TEMPERATURE or p.top_k == 1


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_history(p: SamplingParams) -> bool:
    """Whether the row's token history is needed: penalties, and logits processors."""
    return _penalized(p) or bool(p.logits_processors)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        # Unseeded requests share one generator; every TP rank seeds it alike, so ranks draw alike.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
        params = [r.params for r in rows]
        if all(
            is_greedy(p) and not _processes_logits(r) and p.logprobs is None
            for p, r in zip(params, rows)
        ):
            return SampleOutput(tokens=ops.argmax(logits))
        logits = logits.float()
        if any(_processes_logits(r) for r in rows):
            logits = logits.clone()
            self._apply_bias_and_bans(logits, rows)
            self._apply_penalties(logits, rows)
            errors = _apply_processors(logits, rows)
            errors = self._apply_token_masks(logits, rows) | errors
        else:
            errors = None
        out = SampleOutput(tokens=self._draw(logits, rows), errors=errors or None)
        want = [p.logprobs for p in params if p.logprobs is not None]
        if want:
            logp = torch.log_softmax(logits, dim=-1)
            out.logprobs = logp.gather(1, out.tokens[:, None]).squeeze(1)
            k = max(want)
            if k > 0:
                out.top_logprobs, out.top_ids = top_logprobs(logp, k)
        return out

    def _apply_token_masks(self, logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, str]:
        """-inf for every token a row's mask excludes: all masked rows at once, each packed byte
        unpacked to its 8 bits through a 256-entry table. A row whose mask allows nothing (its
        grammar cannot go on in this vocabulary) is left as it is and returned, row -> why: its
        request fails."""
        vocab = logits.shape[1]
        stuck = {i: NOTHING_ALLOWED for i, r in enumerate(rows)
                 if r.token_mask is not None and _allows_nothing(r.token_mask, vocab)}
        masked = [i for i, r in enumerate(rows) if r.token_mask is not None and i not in stuck]
        if not masked:
            return stuck
        words = torch.stack([rows[i].token_mask for i in masked])
        if logits.is_cuda:
            words = words.pin_memory().to(logits.device, non_blocking=True)
        table = _bit_table(logits.device)
        allowed = table.index_select(0, words.view(torch.uint8).view(-1).int()).view(
            len(masked), -1
        )[:, :vocab]
        index = to_device(masked, torch.long, logits.device)
        logits[index] = torch.where(allowed, logits.index_select(0, index), float("-inf"))
        return stuck

    def _apply_bias_and_bans(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        idx_r, idx_c, vals = [], [], []
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                for tok, bias in r.params.logit_bias.items():
                    if 0 <= tok < logits.shape[1]:
                        idx_r.append(i)
                        idx_c.append(tok)
                        vals.append(bias)
        device = logits.device
        if idx_r:
            logits.index_put_(
                (to_device(idx_r, torch.long, device), to_device(idx_c, torch.long, device)),
                to_device(vals, logits.dtype, device),
                accumulate=True,
            )
        ban_r = [i for i, r in enumerate(rows) for t in r.banned_ids if 0 <= t < logits.shape[1]]
        ban_c = [t for r in rows for t in r.banned_ids if 0 <= t < logits.shape[1]]
        if ban_r:
            logits.index_put_(
                (to_device(ban_r, torch.long, device), to_device(ban_c, torch.long, device)),
                logits.new_full((len(ban_r),), float("-inf")),
            )

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if not _penalized(p):
                continue
            counts = _counts(r.output_ids, vocab, logits)
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = (counts > 0) | (_counts(r.prompt_ids, vocab, logits) > 0)
                penalized = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalized, row))
            if p.frequency_penalty:
                row.sub_(p.frequency_penalty * counts)
            if p.presence_penalty:
                row.sub_(p.presence_penalty * (counts > 0).to(row.dtype))

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy_rows = [is_greedy(r.params) for r in rows]
        argmax = ops.argmax(logits)
        if all(greedy_rows):
            return argmax
        greedy = to_device(greedy_rows, torch.bool, logits.device)
        temps = to_device([r.params.temperature or 1.0 for r in rows], torch.float32, logits.device)
        probs = self._filtered_probs(logits / temps[:, None], rows)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):  # seeded requests: the random numbers of this position
            if r.generator is not None and not is_greedy(r.params):
                r.generator.manual_seed(position_seed(r.params.seed or 0, r.position))
                noise[i] = torch.empty_like(probs[i]).exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)  # exponential race == a draw from probs
        return torch.where(greedy, argmax, sampled)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device)
            k = to_device(top_k, torch.long, logits.device)
            sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            p = to_device(top_p, logits.dtype, logits.device)
            sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0 for m in min_p):
            m = to_device(min_p, probs.dtype, logits.device)
            probs = probs.masked_fill(probs < m[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs


def position_seed(seed: int, position: int) -> int:
    """A seeded request's generator seed for the token at `position` (splitmix64's mixing of both,
    kept below 2**63 as torch's generators require)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _allows_nothing(mask: torch.Tensor, vocab: int) -> bool:
    """Whether a packed mask (on the host: no device sync) allows no token below `vocab`."""
    full, rest = divmod(vocab, 32)
    return not bool(mask[:full].any()) and (rest == 0 or not int(mask[full]) & ((1 << rest) - 1))


def _processes_logits(r: SamplingRow) -> bool:
    return (
        r.token_mask is not None
        or bool(r.params.logit_bias)
        or bool(r.banned_ids)
        or needs_history(r.params)
    )


def _apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, str]:
    """Each row's JAX logits processors, in order, on its own row (so a row never depends on its
    batch); a processor that fails leaves its row as it was and fails the row's request: row -> the
    error."""
    errors: dict[int, str] = {}
    for i, r in enumerate(rows):
        if not r.params.logits_processors:
            continue
        from compiled_engine.jax import bridge

        history = torch.cat([r.prompt_ids, r.output_ids])
        for processor in r.params.logits_processors:
            try:
                bridge.apply(bridge.resolve(processor), history, logits[i])
            except (bridge.ProcessorError, ValueError) as e:
                errors[i] = str(e)
                break
    return errors


def _counts(ids: torch.Tensor | None, vocab: int, logits: torch.Tensor) -> torch.Tensor:
    """[vocab] occurrences of each token id in `ids` (ids outside the vocabulary count nowhere),
    without the host sync a boolean-mask selection would make."""
    counts = torch.zeros(vocab, device=logits.device, dtype=logits.dtype)
    if ids is not None and ids.numel():
        ids = ids.long()
        inside = (ids >= 0) & (ids < vocab)
        counts.index_add_(0, ids.clamp(0, vocab - 1), inside.to(logits.dtype))
    return counts


@functools.cache
def _bit_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte, least significant first (xgrammar's bitmask order)."""
    return (
        (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    ).bool()
