"""`bench speculative`: decode with and without speculation, side by side in one process.

Two engines on one checkpoint (the same settings but `speculative`), each workload through both in
alternating rounds, best round of each kept. Workloads, as chat requests through the model's chat
template, greedy, up to `max_tokens` each:
  copy   rewrite / extract / edit a long given text (prompt lookup finds most of the answer)
  free   open questions (nothing to copy: the policy must get out of the way)
At batch 1 (one request at a time) and at a larger batch (all requests at once, repeated to fill
it). Reports tokens/s of both, their ratio, the acceptance rate, the mean accepted length (tokens a
verify step emits: 1 + accepted drafts), and whether the outputs are identical.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams

PASSAGE = (
    "A serving engine keeps a ledger of every request: the tokens of its prompt, the tokens it has "
    "generated, and the pages of the key-value cache that hold what the model computed for them. "
    "Each step, the scheduler admits waiting requests while the token budget and the free pages "
    "last, gives every running request one more position to compute, and hands the runner a plan. "
    "The runner turns the plan into tensors, runs the compiled model, and samples one token per "
    "request. When a request finishes, its prompt stays in the prefix cache, so that the next "
    "request with the same beginning skips that work. When the pages run out, the latest request "
    "is retracted: it gives back its pages and waits to be computed again."
)
CODE = '''def page_slots(pages, page_size, lo, hi):
    """KV slots of positions [lo, hi)."""
    if page_size == 1:
        return tuple(pages[lo:hi])
    return tuple(pages[p // page_size] * page_size + p % page_size for p in range(lo, hi))


def free_pages(allocator, pages):
    for page in pages:
        allocator.free_list.append(page)
    pages.clear()
'''
WORKLOADS: dict[str, list[str]] = {
    "copy": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Rewrite this text in the past tense, changing nothing else:\n\n{PASSAGE}",
        f"Rename the function `page_slots` to `slots_of` in this code and print the whole code:"
        f"\n\n{CODE}",
        f"Copy the sentences of this text that mention pages, one per line:\n\n{PASSAGE}",
    ],
    "free": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a refrigerator works to a ten-year-old.",
        "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
        "Why is the sky blue? Answer in a paragraph.",
    ],
}


@dataclass
class Measured:
    tokens: int = 0
    seconds: float = float("inf")
    outputs: list[list[int]] = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


def _round(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> Measured:
    """`prompts` through `llm`, `batch` at a time (the list repeated to fill a batch)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stats0 = llm.engine.scheduler.stats()
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    if batch > 1:
        chats = list(itertools.islice(itertools.cycle(chats), batch))
    groups = [chats[i : i + batch] for i in range(0, len(chats), batch)]
    m = Measured()
    t0 = time.perf_counter()
    for group in groups:
        for out in llm.generate(group, params, use_tqdm=False):
            m.outputs.append(out.token_ids)
            m.tokens += len(out.token_ids)
    m.seconds = time.perf_counter() - t0
    stats = llm.engine.scheduler.stats()
    m.drafts = stats.spec_num_drafts - stats0.spec_num_drafts
    m.draft_tokens = stats.spec_num_draft_tokens - stats0.spec_num_draft_tokens
    m.accepted = stats.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
    return m


def run(model: str, spec: dict, batches: list[int], rounds: int, max_tokens: int,
        log: Callable[[str], None] = print, **engine_kwargs) -> list[dict]:
    """Both engines, every workload at every batch size, `rounds` alternating rounds each."""
    llms = {"plain": LLM(model, **engine_kwargs),
            "speculative": LLM(model, speculative=spec, **engine_kwargs)}
    for llm in llms.values():  # warm: first steps, graphs loaded
        _round(llm, WORKLOADS["free"][:1], 1, 8)
    rows = []
    for name, prompts in WORKLOADS.items():
        for batch in batches:
            best: dict[str, Measured] = {}
            for _ in range(rounds):
                for label, llm in llms.items():
                    m = _round(llm, prompts, batch, max_tokens)
                    if label not in best or m.seconds < best[label].seconds:
                        best[label] = m
            plain, spec_m = best["plain"], best["speculative"]
            row = {
                "workload": name, "batch": batch,
                "plain_tok_s": plain.tokens_per_s, "spec_tok_s": spec_m.tokens_per_s,
                "ratio": spec_m.tokens_per_s / plain.tokens_per_s,
                "acceptance": spec_m.acceptance,
                "mean_accepted_length": spec_m.mean_accepted_length,
                "drafts": spec_m.drafts, "tokens": plain.tokens,
                "identical": plain.outputs == spec_m.outputs,
            }
            log(f"{name} batch {batch}: plain {row['plain_tok_s']:.1f} tok/s, speculative "
                f"{row['spec_tok_s']:.1f} tok/s ({row['ratio']:.2f}x), acceptance "
                f"{row['acceptance']:.0%}, mean accepted length {row['mean_accepted_length']:.2f}, "
                f"identical outputs: {row['identical']}")
            rows.append(row)
    for llm in llms.values():
        llm.engine.shutdown()
    return rows
