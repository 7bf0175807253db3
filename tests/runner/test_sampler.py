"""The sampler draws from the distribution the sampling parameters describe."""

from __future__ import annotations

import math

import pytest
import torch

from compiled_engine.runner.sampler import Sampler, SamplingRow
from compiled_engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N = 20000


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=1234)
    rows = [SamplingRow(params) for _ in range(n)]
    return sampler(logits.expand(n, -1).clone(), rows).tokens


def assert_frequencies(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / tokens.numel()
    for i, (f, e) in enumerate(zip(freq.tolist(), expected.double().tolist())):
        tol = 4.5 * math.sqrt(max(e * (1 - e), 1e-12) / tokens.numel()) + 1e-9
        assert abs(f - e) <= tol, f"token {i}: frequency {f:.4f}, expected {e:.4f}"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature: float) -> None:
    tokens = draw(SamplingParams(temperature=temperature))
    assert_frequencies(tokens, torch.softmax(LOGITS / temperature, dim=-1))


def test_top_k_keeps_the_k_most_likely() -> None:
    tokens = draw(SamplingParams(top_k=3))
    expected = torch.zeros(6)
    expected[:3] = torch.softmax(LOGITS[:3], dim=-1)
    assert_frequencies(tokens, expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.softmax(LOGITS, dim=-1)  # [0.57, 0.21, 0.13, 0.08, ...]
    tokens = draw(SamplingParams(top_p=0.8))
    expected = torch.zeros(6)
    expected[:3] = probs[:3] / probs[:3].sum()  # 0.57 + 0.21 < 0.8, so the third token is kept too
    assert_frequencies(tokens, expected)


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    tokens = draw(SamplingParams(min_p=0.2))
    keep = probs >= 0.2 * probs.max()
    expected = torch.where(keep, probs, torch.zeros_like(probs))
    assert_frequencies(tokens, expected / expected.sum())


def test_greedy_and_top_k_1_take_the_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"))
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5)):
        out = sampler(logits, [SamplingRow(params) for _ in range(8)])
        assert torch.equal(out.tokens, logits.argmax(-1))


def test_seeded_request_is_reproducible_regardless_of_neighbours() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=7)

    def run(neighbour: SamplingParams, position: int) -> int:
        rows = [SamplingRow(neighbour) for _ in range(4)]
        rows[position] = SamplingRow(seeded, generator=torch.Generator().manual_seed(7))
        batch = logits.clone()
        batch[position] = logits[0]
        return Sampler(torch.device("cpu"), seed=position)(batch, rows).tokens[position].item()

    firsts = {run(SamplingParams(temperature=0.0), 0), run(SamplingParams(temperature=2.0), 2),
              run(SamplingParams(top_k=5), 3)}
    assert len(firsts) == 1


def test_logit_bias_and_penalties_change_the_right_logits() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    sampler = Sampler(torch.device("cpu"))
    # A bias makes token 7 the argmax.
    out = sampler(logits, [SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 5.0}))])
    assert out.tokens.tolist() == [7]
    # Frequency penalty on the generated token 3 (seen twice) pushes it below 0 -> another token
    # wins.
    row = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0),
                      output_ids=torch.tensor([3, 3]), prompt_ids=torch.tensor([5]))
    out = sampler(logits, [row])
    assert out.tokens.item() != 3
    # Repetition penalty divides a positive logit of a prompt token: 1.0 -> 0.5.
    row = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=10),
                      output_ids=torch.tensor([], dtype=torch.long), prompt_ids=torch.tensor([3]))
    out = sampler(logits, [row])
    expected = torch.log_softmax(torch.where(torch.arange(10) == 3, 0.5, 0.0), dim=-1)
    assert torch.allclose(out.top_logprobs[0].sort().values, expected.sort().values, atol=1e-6)


def test_banned_ids_are_never_drawn_and_logprobs_match_the_choice() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    out = Sampler(torch.device("cpu"))(
        logits, [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), banned_ids=(0,))]
    )
    assert out.tokens.item() in (1, 2)
    assert out.logprobs.item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert out.top_ids.shape == (1, 2)


def _packed(allowed: list[int], vocab: int) -> torch.Tensor:
    """xgrammar's bitmask layout: bit t % 32 of int32 word t // 32."""
    words = [0] * (-(-vocab // 32))
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)


def test_a_token_mask_restricts_every_rule_and_renormalizes_logprobs() -> None:
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [3, 31, 32, 63, 99]
    mask = _packed(allowed, vocab)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=8), token_mask=mask),
        SamplingRow(
            SamplingParams(temperature=1.0, logprobs=8),
            torch.Generator().manual_seed(1),
            token_mask=mask,
        ),
        SamplingRow(SamplingParams(temperature=0, logprobs=8)),
    ]  # an unconstrained neighbour
    out = Sampler(torch.device("cpu"))(logits, rows)
    assert int(out.tokens[0]) == max(allowed, key=lambda t: float(logits[0, t]))
    assert int(out.tokens[1]) in allowed
    assert int(out.tokens[2]) == int(logits[2].argmax())
    for row in (0, 1):
        finite = [
            (int(t), float(lp))
            for t, lp in zip(out.top_ids[row], out.top_logprobs[row])
            if lp > -math.inf
        ]
        assert sorted(t for t, _ in finite) == allowed
        assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-5)


def test_a_mask_that_allows_nothing_fails_its_row_only() -> None:
    """Not lifted (the row would run unconstrained): the row is reported as an error, its neighbours
    drawn as usual. Bits past the vocabulary (here token 100 of a 100-token vocabulary) allow
    nothing."""
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0), token_mask=_packed([7, 40], vocab)),
            SamplingRow(SamplingParams(temperature=0), token_mask=_packed([100], vocab)),
            SamplingRow(SamplingParams(temperature=0))]
    out = Sampler(torch.device("cpu"))(logits, rows)
    assert set(out.errors) == {1} and "allows no next token" in out.errors[1]
    assert int(out.tokens[0]) in (7, 40) and int(out.tokens[2]) == int(logits[2].argmax())
