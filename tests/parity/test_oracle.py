"""The parity check itself: it passes an engine that is fp32 up to bf16-sized noise and fails each
way an engine can be wrong (the chosen token's log-prob, the typical step, one far-off token, a
token fp32 ranks low, a greedy divergence that is no near tie). The engine here is a stand-in whose
next-token log-probs are fp32's plus a chosen perturbation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from compiled_engine.llm import CompletionOutput
from tests.helpers.oracle import Bounds, Reference, Spread, check

VOCAB, STEPS = 50, 6
PROMPTS = [[1, 2, 3], [4, 5]]
BOUNDS = Bounds.bf16(Spread(chosen=0.05, top=0.1, typical=0.04))


def _reference(seed: int) -> Reference:
    logits = torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 7] += 10  # a clear winner at every step: no near tie
    logprobs = torch.log_softmax(logits, -1)
    return Reference(logprobs.argmax(-1).tolist(), logprobs)


REFS = [_reference(0), _reference(1)]


@dataclass
class _Request:
    outputs: list[CompletionOutput]


class FakeEngine:
    """`generate` as `LLM`'s, greedy: each step's log-probs are fp32's at that prefix, perturbed by
    `noise(prompt_index, step, logprobs)` (only in multi-token runs with `greedy_only`: the check's
    greedy run, not its teacher-forced one)."""

    def __init__(
        self, noise: Callable[[int, int, torch.Tensor], torch.Tensor], greedy_only: bool = False
    ) -> None:
        self.noise, self.greedy_only = noise, greedy_only

    def _logprobs(self, ids: list[int], perturb: bool) -> torch.Tensor:
        p = next(i for i, prompt in enumerate(PROMPTS) if ids[:len(prompt)] == prompt)
        step = len(ids) - len(PROMPTS[p])
        lp = REFS[p].logprobs[min(step, STEPS - 1)].clone()
        return self.noise(p, step, lp) if perturb else lp

    def generate(self, prompts: list[list[int]], params) -> list[_Request]:
        out = []
        perturb = params.max_tokens > 1 or not self.greedy_only
        for prompt in prompts:
            ids, tokens, chosen, top = list(prompt), [], [], []
            for _ in range(params.max_tokens):
                lp = self._logprobs(ids, perturb)
                token = int(lp.argmax())
                ranked = lp.topk(params.logprobs or 1)
                tokens.append(token)
                chosen.append(lp[token].item())
                top.append(list(zip(ranked.indices.tolist(), ranked.values.tolist(), strict=True)))
                ids.append(token)
            out.append(
                _Request(
                    [CompletionOutput(0, "", tokens, "length", logprobs=chosen, top_logprobs=top)]
                )
            )
        return out


def _shift(where: Callable[[int, int], bool], token: Callable[[torch.Tensor], int], by: float):
    def noise(p: int, step: int, lp: torch.Tensor) -> torch.Tensor:
        if where(p, step):
            lp[token(lp)] += by
        return lp
    return noise


def _jitter(scale: float):
    def noise(p: int, step: int, lp: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * p + step)
        return lp + scale * (torch.rand(lp.shape, generator=g) * 2 - 1)
    return noise


def test_an_engine_within_bf16_noise_passes() -> None:
    agreement = check(FakeEngine(_jitter(0.02)), PROMPTS, REFS, BOUNDS, "fake")
    assert agreement.greedy_steps == len(PROMPTS) * STEPS and not agreement.divergences
    assert agreement.steps == 2 * agreement.greedy_steps  # and each teacher-forced


def _raise_non_chosen(by: float):
    def noise(p: int, step: int, lp: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.arange(VOCAB) == lp.argmax(), lp, lp + by)
    return noise


def _promote_low_ranked(p: int, step: int, lp: torch.Tensor) -> torch.Tensor:
    """fp32's 30th token placed second: outside fp32's top tokens, so only the ranking check sees
    it."""
    if step == 4:
        ranked = lp.topk(30).indices
        lp[ranked[29]] = lp[ranked[1]] + 0.01
    return lp


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            FakeEngine(_shift(lambda p, s: p == 1 and s == 3, lambda lp: int(lp.argmax()), -0.3)),
            "chosen-token log-probs",
        ),
        (FakeEngine(_raise_non_chosen(0.1)), "typical log-prob error"),
        (
            FakeEngine(_shift(lambda p, s: s == 2, lambda lp: int(lp.topk(5).indices[4]), 0.4)),
            "a top token's log-prob far off",
        ),
        (FakeEngine(_promote_low_ranked), "tokens in our top k that fp32 ranks far below"),
        (
            FakeEngine(
                _shift(lambda p, s: p == 0 and s == 1, lambda lp: int(lp.topk(2).indices[1]), 30.0),
                greedy_only=True,
            ),
            "not near a tie",
        ),
    ],
    ids=["chosen", "typical", "top", "ranking", "divergence"],
)
def test_each_way_of_being_wrong_fails(engine: FakeEngine, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check(engine, PROMPTS, REFS, BOUNDS, "fake")


def test_the_emulated_bf16_rounding_is_bf16_noise_and_the_same_for_a_seed() -> None:
    """`bf16_rounding` rounds each value to one of its two bf16 neighbours, up as often as the
    distance says (unbiased), and a seed gives the same bits every time."""
    from tests.helpers.oracle import bf16_rounding

    linear = torch.nn.Linear(64, 64)  # the identity: what comes out is the input, rounded
    with torch.no_grad():
        linear.weight.copy_(torch.eye(64))
        linear.bias.zero_()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    exact = x
    with torch.no_grad(), bf16_rounding(linear, seed=5) as rounded:
        once = rounded(x)
    with torch.no_grad(), bf16_rounding(linear, seed=5) as rounded:
        again = rounded(x)
    assert torch.equal(once, again)
    assert torch.equal(once, once.to(torch.bfloat16).float())  # bf16 values
    down = exact.to(torch.bfloat16).float()  # a bf16 neighbour; the other is an ulp away
    ulp = (down.abs() * 2 ** -7).clamp_min(1e-30)
    assert ((once - exact).abs() <= 2 * ulp).all()
    assert (once - exact).abs().max() > 0  # it rounded
    bias = (once - exact).mean().abs().item()
    assert bias < 0.05 * (once - exact).abs().mean().item()  # as often up as down
    quarter = torch.full((512, 64), 1.0 + 2 ** -7 / 4)  # a quarter of the way from 1 to its next
    with torch.no_grad(), bf16_rounding(linear, seed=6) as rounded:
        up = (rounded(quarter) > 1).float().mean().item()
    assert 0.22 < up < 0.28  # up a quarter of the time: stochastic (nearest would never go up)
    with torch.no_grad(), bf16_rounding(linear, seed=7) as rounded:
        assert not torch.equal(rounded(x), once)  # another seed, other noise
    assert torch.equal(linear(x).detach(), exact)  # the hooks are gone
