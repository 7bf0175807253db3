"""The correctness oracle of the parity tests: transformers in fp32 on the same checkpoint (bf16
weights upcast exactly), greedy, with the log-probabilities of every step; how far a bf16 run may be
from it (the bf16 spread: the worst of transformers' own bf16 run at the portable ISA level and of
emulated bf16 runs that are the same on every CPU); and how an engine's greedy outputs agree with
it.

Run as `python -m tests.helpers.oracle IN OUT` it measures a spread in this process (what
`hf_bf16_spread` starts at the portable level)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from compiled_engine.llm import LLM
from compiled_engine.sampling_params import SamplingParams
from kernels.cpu import isa

REPO = Path(__file__).resolve().parents[2]
NEAR_TIE_GAP = 0.25  # fp32's top two log-probs this close: bf16 may pick either


@dataclass
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab] fp32 log-softmax of each step's logits


@functools.lru_cache(maxsize=2)
def hf_model(path: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """transformers' model of a checkpoint directory or a GGUF file (which it dequantizes to fp32
    first); the last two are kept, so that the modules comparing against the same checkpoint load it
    once."""
    from transformers import AutoModelForCausalLM

    where = Path(path)
    if where.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(where.parent), gguf_file=where.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def hf_fp32_greedy(
    path: str, prompts: list[list[int]], new_tokens: int, device: str = "cpu"
) -> list[Reference]:
    """Plain argmax steps over transformers' KV cache: no EOS handling (`generate`'s min_new_tokens
    would mask EOS, while the engine's ignore_eos still picks it when it is the argmax). Log-probs
    come back on the CPU."""
    return module_fp32_greedy(hf_model(path, torch.float32, device), prompts, new_tokens, device)


def module_fp32_greedy(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                       device: str = "cpu") -> list[Reference]:
    """`hf_fp32_greedy` of a model built in this process (transformers + PEFT)."""
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf(torch.tensor([prompt], device=device), use_cache=True)
            tokens, logprobs = [], []
            for _ in range(new_tokens):
                lp = torch.log_softmax(out.logits[0, -1].float(), -1).cpu()
                tokens.append(int(lp.argmax()))
                logprobs.append(lp)
                out = hf(
                    torch.tensor([[tokens[-1]]], device=device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            refs.append(Reference(tokens, torch.stack(logprobs)))
    return refs


@dataclass
class Spread:
    """How far a bf16 run's log-probabilities are from fp32's over fp32's `top` most likely tokens
    of each step: the largest error on the chosen (greedy) token, the largest on any of them (a
    low-ranked token's log-prob is the most sensitive: noisy, a few steps decide it), and the median
    over steps of each step's largest (the typical error)."""

    chosen: float
    top: float
    typical: float

    @staticmethod
    def worst(spreads: list[Spread]) -> Spread:
        return Spread(*(max(getattr(x, f) for x in spreads) for f in ("chosen", "top", "typical")))


def _spread_here(
    path: str, prompts: list[list[int]], refs: list[Reference], top: int, device: str
) -> Spread:
    """transformers bf16 teacher-forced on fp32's tokens, in this process."""
    return _spread_of(hf_model(path, torch.bfloat16, device), prompts, refs, top, device)


def _spread_of(hf: torch.nn.Module, prompts: list[list[int]], refs: list[Reference], top: int,
               device: str) -> Spread:
    chosen, step_worst = 0.0, []
    with torch.inference_mode():
        for prompt, ref in zip(prompts, refs, strict=True):
            ids = torch.tensor([prompt + ref.tokens[:-1]], device=device)
            lp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:].float(), -1).cpu()
            ids_top = ref.logprobs.topk(top, -1).indices
            errors = (lp.gather(1, ids_top) - ref.logprobs.gather(1, ids_top)).abs()
            step_worst += errors.max(1).values.tolist()
            mine = torch.tensor(ref.tokens)[:, None]
            chosen = max(
                chosen, (lp.gather(1, mine) - ref.logprobs.gather(1, mine)).abs().max().item()
            )
    return Spread(chosen, max(step_worst), statistics.median(step_worst))


@contextlib.contextmanager
def bf16_rounding(model: torch.nn.Module, seed: int):
    """An fp32 model run as a bf16 one: every linear's input and output and every decoder layer's
    hidden state rounded to bf16, stochastically (up or down with the odds of the distance, from a
    generator seeded with `seed`), fp32 arithmetic in between, which every CPU does alike up to
    summation order. Each seed is one sample of bf16-sized rounding noise (stochastic rounding is
    somewhat noisier than rounding to nearest: a bound set by it errs wide, never tight)."""
    gen = torch.Generator().manual_seed(seed)

    def rounded(value):
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            bits = value.contiguous().view(torch.int32)
            noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int32)
            return ((bits + noise) & -(1 << 16)).view(torch.float32)
        if isinstance(value, tuple):
            return tuple(rounded(v) for v in value)
        return value

    handles = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda m, args: rounded(args)))
        if isinstance(module, torch.nn.Linear) or type(module).__name__.endswith("DecoderLayer"):
            handles.append(module.register_forward_hook(lambda m, args, out: rounded(out)))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def emulated_bf16_spread(path: str, prompts: list[list[int]], refs: list[Reference], top: int,
                         seed: int) -> Spread:
    """The spread of one emulated bf16 forward (`bf16_rounding`): the same on every machine,
    whatever its own bf16 GEMMs do."""
    with bf16_rounding(hf_model(path, torch.float32), seed) as model:
        return _spread_of(model, prompts, refs, top, "cpu")


EMULATED_SEEDS = range(4)  # emulated bf16 runs beside transformers' own (`bf16_rounding`)


def hf_bf16_spread(path: str, prompts: list[list[int]], refs: list[Reference], top: int,
                   device: str = "cpu") -> Spread:
    """How far a bf16 forward of this checkpoint may be from fp32: on the CPU the worst of
    transformers' own bf16 run, measured in a new process capped at the portable ISA level
    (`kernels.cpu.isa.PORTABLE`: a bound that followed the machine's best GEMMs would be tightest
    exactly where the oracle is best), and of `EMULATED_SEEDS` emulated bf16 runs (of the largest
    low-ranked error, the noisiest figure, their median). One bf16 run is
    one sample of rounding noise (its chosen-token error varies by 2x from sample to sample,
    docs/benchmarks.md), and transformers' own sample differs by CPU family even when capped; the
    emulated ones are the same on every machine, so no machine's oracle can tighten the bound below
    them. On a GPU, transformers' bf16 on that GPU."""
    if device != "cpu":
        return _spread_here(path, prompts, refs, top, device)
    emulated = [emulated_bf16_spread(path, prompts, refs, top, seed) for seed in EMULATED_SEEDS]
    return _combined(_portable_hf_bf16_spread(path, prompts, refs, top), emulated)


def _combined(hf: Spread, emulated: list[Spread]) -> Spread:
    """The worst of a bf16 run and the emulated ones; the low-ranked maximum, the noisiest figure,
    from the emulated runs' median: no one seed widens the sanity bound on it."""
    worst = Spread.worst([hf, *emulated])
    return Spread(worst.chosen, max(hf.top, statistics.median(e.top for e in emulated)),
                  worst.typical)


def module_bf16_spread(fp32_model: Callable[[], torch.nn.Module], prompts: list[list[int]],
                       refs: list[Reference], top: int) -> Spread:
    """`hf_bf16_spread` of a model built in this process (transformers + PEFT): its bf16 run here
    and the emulated runs of its fp32 model (`fp32_model()` makes one)."""
    bf16 = _spread_of(fp32_model().to(torch.bfloat16), prompts, refs, top, "cpu")
    emulated = []
    for seed in EMULATED_SEEDS:
        with bf16_rounding(fp32_model(), seed) as model:
            emulated.append(_spread_of(model, prompts, refs, top, "cpu"))
    return _combined(bf16, emulated)


def _portable_hf_bf16_spread(path: str, prompts: list[list[int]], refs: list[Reference],
                             top: int) -> Spread:
    with tempfile.TemporaryDirectory() as tmp:
        given, got = Path(tmp) / "in.pt", Path(tmp) / "out.json"
        torch.save(
            {
                "path": path,
                "prompts": prompts,
                "refs": [(r.tokens, r.logprobs) for r in refs],
                "top": top,
            },
            given,
        )
        env = os.environ | isa.env_caps(isa.PORTABLE)
        run = subprocess.run(
            [sys.executable, "-m", "tests.helpers.oracle", str(given), str(got)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert run.returncode == 0, (
            f"measuring transformers' bf16 spread failed:\n{run.stderr[-3000:]}"
        )
        return Spread(**json.loads(got.read_text()))


@dataclass
class Bounds:
    """What an engine's agreement with fp32 may reach: `chosen`, `typical` and `top` bound the
    matching `Agreement` errors; `gap`, fp32's margin at a divergence (a near tie); `rank_slack`,
    how far below fp32's k-th log-prob a token in the engine's top k may sit."""

    chosen: float
    typical: float
    top: float
    gap: float
    rank_slack: float

    @classmethod
    def exact(cls, tolerance: float) -> Bounds:
        """fp32: the same arithmetic up to summation order."""
        return cls(tolerance, tolerance, tolerance, tolerance, tolerance)

    @classmethod
    def bf16(cls, spread: Spread) -> Bounds:
        """As close as the worst bf16 sample of `hf_bf16_spread` is, with room; the
        largest low-ranked error twice as wide, a sanity bound that a wrong forward (errors of whole
        nats) still fails, and as much room for a token of our top k below fp32's k-th (a token
        outside fp32's top that we rank high); a divergence only where fp32's top two are within
        NEAR_TIE_GAP."""
        top = 2 * spread.top + 0.05
        return cls(chosen=1.5 * spread.chosen + 0.02, typical=1.5 * spread.typical + 0.02, top=top,
                   gap=NEAR_TIE_GAP, rank_slack=top)


TOP = 5  # fp32's top tokens compared at each step (the engine's top TOP - 1 checked for rank)
FORCED_TOP = 20  # log-probs the engine returns per step: fp32's top tokens are found among them


@dataclass
class Agreement:
    """How an engine agrees with fp32, over fp32's top tokens at each step compared: every step
    teacher-forced on fp32's tokens (as the spread is measured; prefill steps), and the greedy run's
    own steps up to each prompt's first divergence (decode steps, graphs and overlap).
    `step_errors`, each compared step's largest |engine - fp32| log-probability; `max_chosen_error`,
    the same on fp32's chosen tokens; `misranked`, (prompt, step, token, how far fp32's log-prob of
    it is below fp32's k-th) for each token of the engine's top k that fp32 ranks far lower;
    `divergences`, (prompt, step, fp32 log-prob of its token minus of ours) at each prompt's first
    greedy token that differs from fp32's."""

    step_errors: list[float] = field(default_factory=list)
    max_chosen_error: float = 0.0
    misranked: list[tuple[int, int, int, float]] = field(default_factory=list)
    divergences: list[tuple[int, int, float]] = field(default_factory=list)
    greedy_steps: int = 0

    @property
    def steps(self) -> int:
        return len(self.step_errors)

    @property
    def max_error(self) -> float:
        return max(self.step_errors, default=0.0)

    @property
    def typical_error(self) -> float:
        return statistics.median(self.step_errors) if self.step_errors else 0.0

    def score(
        self,
        where: tuple[int, int],
        lp: torch.Tensor,
        chosen: int,
        ranked: list[tuple[int, float]],
        top: int,
        rank_slack: float,
    ) -> None:
        """One step: fp32's log-probs `lp` and its `chosen` token against the engine's `ranked` top
        tokens."""
        ours = dict(ranked)
        wanted = lp.topk(top).indices.tolist()
        missing = [t for t in wanted if t not in ours]
        assert not missing, (
            f"prompt {where[0]} step {where[1]}: fp32's top tokens {missing} not in our top "
            f"{len(ranked)}"
        )
        self.step_errors.append(max(abs(ours[t] - lp[t].item()) for t in wanted))
        self.max_chosen_error = max(self.max_chosen_error, abs(ours[chosen] - lp[chosen].item()))
        kth = lp[wanted[top - 2]].item()
        self.misranked += [(*where, t, kth - lp[t].item()) for t, _ in ranked[:top - 1]
                           if lp[t].item() < kth - rank_slack]

    def report(self, what: str) -> str:
        gaps = (
            ", ".join(f"prompt {p} step {s}: fp32 gap {g:.4f}" for p, s, g in self.divergences)
            or "none"
        )
        return (
            f"{what}: |logprob error| chosen tokens max {self.max_chosen_error:.2e}, top tokens "
            f"median step {self.typical_error:.2e} max {self.max_error:.2e}, over "
            f"{self.steps - self.greedy_steps} teacher-forced and {self.greedy_steps} greedy "
            f"steps; greedy divergences: {gaps}"
        )


def _greedy(llm: LLM, prompts: list[list[int]], refs: list[Reference], top: int, rank_slack: float,
            agreement: Agreement, lora_request=None) -> None:
    """The engine's own greedy run: each prompt's steps compared while its tokens equal fp32's; at a
    divergence, fp32's gap between its token and ours."""
    params = SamplingParams(
        max_tokens=len(refs[0].tokens), temperature=0.0, ignore_eos=True, logprobs=FORCED_TOP
    )
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, **_lora(lora_request))]
    for p, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        assert len(out.token_ids) == len(ref.tokens)
        for step, (ours, theirs) in enumerate(zip(out.token_ids, ref.tokens, strict=True)):
            if ours != theirs:
                agreement.divergences.append(
                    (p, step, (ref.logprobs[step, theirs] - ref.logprobs[step, ours]).item())
                )
                break
            agreement.score(
                (p, step), ref.logprobs[step], theirs, out.top_logprobs[step], top, rank_slack
            )
            agreement.greedy_steps += 1


def _teacher_forced(
    llm: LLM,
    prompts: list[list[int]],
    refs: list[Reference],
    top: int,
    rank_slack: float,
    agreement: Agreement,
    lora_request=None,
) -> None:
    """The engine's next-token log-probs after the prompt and each prefix of fp32's tokens (one
    request each)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=FORCED_TOP)
    forced = [prompt + ref.tokens[:step] for prompt, ref in zip(prompts, refs, strict=True)
              for step in range(len(ref.tokens))]
    outputs = iter(o.outputs[0] for o in llm.generate(forced, params, **_lora(lora_request)))
    for p, ref in enumerate(refs):
        for step, lp in enumerate(ref.logprobs):
            agreement.score(
                (p, step), lp, ref.tokens[step], next(outputs).top_logprobs[0], top, rank_slack
            )


def _lora(lora_request) -> dict:
    """`generate`'s adapter argument, only when there is one (the oracle's own tests fake `LLM`)."""
    return {} if lora_request is None else {"lora_request": lora_request}


def check(llm: LLM, prompts: list[list[int]], refs: list[Reference], bounds: Bounds, what: str,
          top: int = TOP, lora_request=None) -> Agreement:
    """Assert what a user of the engine would see as 'the same model' as fp32: greedy tokens equal
    fp32's up to near ties, and log-probabilities within `bounds` at every step teacher-forced on
    fp32's tokens and at each greedy step before a divergence; the engine's top k (k = `top` - 1)
    ranked where fp32 ranks it. `lora_request`: every request's adapter (the references then come
    from the adapter merged into the checkpoint)."""
    agreement = Agreement()
    _greedy(llm, prompts, refs, top, bounds.rank_slack, agreement, lora_request)
    _teacher_forced(llm, prompts, refs, top, bounds.rank_slack, agreement, lora_request)
    report = agreement.report(what) + f" (bounds {bounds})"
    print(report)
    assert agreement.max_chosen_error <= bounds.chosen, f"chosen-token log-probs too far: {report}"
    assert agreement.typical_error <= bounds.typical, f"typical log-prob error too large: {report}"
    assert agreement.max_error <= bounds.top, f"a top token's log-prob far off: {report}"
    assert not agreement.misranked, f"tokens in our top k that fp32 ranks far below its k-th: " \
                                    f"{agreement.misranked[:5]}: {report}"
    for prompt, step, gap in agreement.divergences:
        assert gap <= bounds.gap, (
            f"prompt {prompt} diverged at step {step} where fp32 was not near a tie "
            f"(gap {gap:.4f}): {report}"
        )
    return agreement


def _main(given: str, got: str) -> None:
    job = torch.load(given)
    refs = [Reference(tokens, logprobs) for tokens, logprobs in job["refs"]]
    spread = _spread_here(job["path"], job["prompts"], refs, job["top"], "cpu")
    Path(got).write_text(json.dumps(asdict(spread)))


if __name__ == "__main__":
    _main(*sys.argv[1:])
