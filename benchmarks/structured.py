"""The cost of structured output: `python -m benchmarks.structured`.

1. Mask cost per constrained row per step: filling a request's token mask (xgrammar) and applying it
   in the sampler, on SmolLM2's 49152-token vocabulary, for a JSON schema and a regex.
2. Decode throughput of the bench model at batch 32 with 0%, 50% and 100% of the rows constrained (a
   regex no row can finish within max_tokens, so every row decodes the same number of tokens), run
   alternately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.models import bench_model_dir
from compiled_engine.constraints import GrammarBook
from compiled_engine.llm import LLM
from compiled_engine.models.names import SMOLLM2_NAME, resolve_model
from compiled_engine.runner.sampler import Sampler, SamplingRow
from compiled_engine.sampling_params import SamplingParams, StructuredOutput
from compiled_engine.tokenization import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    },
    "required": ["name", "tags"],
}
LONG = StructuredOutput("regex", "[a-z ]{400}")


def mask_cost(steps: int) -> None:
    tokenizer = load_tokenizer(resolve_model(SMOLLM2_NAME))
    vocab = len(tokenizer)
    book = GrammarBook(lambda: tokenizer, vocab, [tokenizer.eos_token_id])
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(1, vocab)
    print(
        f"## mask cost per constrained row per step (SmolLM2 vocabulary, {vocab} tokens), median us"
    )
    for label, spec in (
        ("json schema", StructuredOutput("json", json.dumps(SCHEMA))),
        ("regex", LONG),
    ):
        grammar = book.for_request(spec)
        fill, apply, plain = [], [], []
        greedy = SamplingParams(temperature=0)
        for _ in range(steps):
            t0 = time.perf_counter()
            mask = grammar.next_mask()
            t1 = time.perf_counter()
            token = int(sampler(logits, [SamplingRow(greedy, token_mask=mask)]).tokens[0])
            t2 = time.perf_counter()
            sampler(logits, [SamplingRow(greedy)])
            t3 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            plain.append(t3 - t2)
            if not grammar.accept(token) or grammar.complete:
                grammar = book.for_request(spec)
        print(
            f"{label:12s} fill the mask {statistics.median(fill) * 1e6:7.1f}  greedy sampling with "
            f"the mask {statistics.median(apply) * 1e6:7.1f}  without "
            f"{statistics.median(plain) * 1e6:7.1f}"
        )


def throughput(rounds: int, new_tokens: int) -> None:
    llm = LLM(str(bench_model_dir()), num_pages=16384, max_running=32, chunk_budget=4096)
    prompts = [[1 + (i * 37 + j) % 7000 for j in range(32)] for i in range(32)]
    plain = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=new_tokens, temperature=0, ignore_eos=True, structured=LONG
    )
    llm.generate(prompts[:4], [constrained] * 4, use_tqdm=False)  # compile the grammar, warm up
    results: dict[int, list[float]] = {0: [], 50: [], 100: []}
    for _ in range(rounds):
        for share in results:
            k = len(prompts) * share // 100
            params = [constrained] * k + [plain] * (len(prompts) - k)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            results[share].append(sum(len(o.token_ids) for o in outs) / seconds)
    print(
        f"\n## bench model, batch 32, {new_tokens} new tokens a row (prefill included), output "
        f"tok/s, best of {rounds}"
    )
    base = max(results[0])
    for share, values in results.items():
        print(
            f"{share:3d}% constrained: {max(values):7.1f}  ({max(values) / base:.3f}x of "
            f"unconstrained)  runs {', '.join(f'{v:.1f}' for v in values)}"
        )
    llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    mask_cost(args.steps)
    throughput(args.rounds, args.new_tokens)


if __name__ == "__main__":
    main()
