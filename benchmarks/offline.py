"""`bench offline`: one workload through our engine, and through the baselines it is compared with,
in one process run, one after the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.datasets import Session
from benchmarks.engine_run import build_llm, close_llm, run_rounds
from benchmarks.metrics import Summary, summarize


def _variant(name: str, base: dict) -> tuple[str, dict]:
    """--compare name -> (run label, engine settings that differ from the base run's)."""
    if name == "naive":
        return "naive prefix cache", {"prefix_cache": "naive"}
    if name == "overlap":
        current = base.get("overlap")
        if current is None:  # the default: on with CUDA, off on the CPU
            import torch

            current = torch.cuda.is_available()
        on = not current
        return f"overlap {'on' if on else 'off'}", {"overlap": on}
    if name == "eager":
        return "eager", {"enforce_eager": True}
    if name == "nondeterministic":
        return "not deterministic", {"deterministic": False}
    if name in ("int8", "int4"):
        return f"--quantization {name}", {"quantization": name}
    raise ValueError(
        f"unknown comparison {name!r}; use hf, naive, overlap, eager, nondeterministic, int8 or "
        "int4"
    )


@dataclass
class TokenAgreement:
    """A run's greedy tokens against the base run's (ours): requests with identical outputs, and the
    mean fraction of each output before the first difference (bf16 near ties make some differ)."""

    identical: int
    requests: int
    common_prefix: float


@dataclass
class OfflineRun:
    label: str
    summary: Summary
    cache_hit_rate: float | None = None
    tokens_vs_base: TokenAgreement | None = None


def token_agreement(base: dict[int, list[int]], other: dict[int, list[int]]) -> TokenAgreement:
    fractions = []
    for i, ours in base.items():
        theirs = other.get(i, [])
        same = next(
            (k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
        )
        fractions.append(same / len(ours) if ours else 1.0)
    identical = sum(base[i] == other.get(i) for i in base)
    return TokenAgreement(
        identical, len(base), sum(fractions) / len(fractions) if fractions else 1.0
    )


@dataclass
class OfflineResult:
    model: str
    dataset: str
    workload: dict
    engine: dict  # the base run's engine settings
    runs: list[OfflineRun] = field(default_factory=list)

    def ratios(self) -> dict[str, dict[str, float]]:
        """Base run over each other run: output throughput ratio and median-TTFT ratio (theirs /
        ours)."""
        base = self.runs[0].summary
        out = {}
        for run in self.runs[1:]:
            s = run.summary
            out[run.label] = {
                "throughput": base.output_throughput / s.output_throughput
                if s.output_throughput
                else float("nan"),
                "ttft_p50": s.ttft_s.p50 / base.ttft_s.p50 if base.ttft_s.p50 else float("nan"),
            }
        return out


def engine_run(model_dir: str, sessions: list[Session], label: str,
               settings: dict) -> tuple[OfflineRun, dict[int, list[int]]]:
    llm = build_llm(model_dir, **settings)
    try:
        t = run_rounds(llm, sessions)
    finally:
        close_llm(llm)
    return OfflineRun(label, summarize(t.timings, t.duration_s), t.cache_hit_rate), t.outputs


def hf_run(model_dir: str, sessions: list[Session], dtype: str = "auto",
           device: str = "auto") -> tuple[OfflineRun, dict[int, list[int]]]:
    from benchmarks.hf_baseline import load_hf_model, run_hf

    timings, duration, outputs = run_hf(load_hf_model(model_dir, dtype, device), sessions)
    label = "transformers generate" + ("" if dtype == "auto" else f" ({dtype})")
    return OfflineRun(label, summarize(timings, duration)), outputs


def run_offline(model_dir: str, sessions: list[Session], settings: dict, compare: list[str],
                log=print, repeats: int = 1) -> list[OfflineRun]:
    """Our engine, then each comparison, `repeats` times over in that order (so that a slow spell of
    a shared machine hits every variant alike); each variant keeps its fastest run (best of
    `repeats`)."""
    base_label = "compiled-engine" + (" (eager)" if settings.get("enforce_eager") else "")
    best: dict[str, OfflineRun] = {}
    base_outputs: dict[int, list[int]] = {}
    for _ in range(repeats):
        for name in [None, *compare]:
            if name is None:
                run, outputs = engine_run(model_dir, sessions, base_label, settings)
                base_outputs = outputs
            elif name in ("hf", "hf-fp32"):
                run, outputs = hf_run(model_dir, sessions, "auto" if name == "hf" else "float32",
                                      settings.get("device", "auto"))
            else:
                label, changes = _variant(name, settings)
                run, outputs = engine_run(model_dir, sessions, label, {**settings, **changes})
            if name is not None:
                run.tokens_vs_base = token_agreement(base_outputs, outputs)
            agree = run.tokens_vs_base
            same = (
                f"; tokens identical to ours in {agree.identical}/{agree.requests} requests"
                if agree
                else ""
            )
            log(f"{run.label}: {run.summary.output_throughput:.1f} output tok/s{same}")
            if (
                run.label not in best
                or run.summary.output_throughput > best[run.label].summary.output_throughput
            ):
                best[run.label] = run
    return list(best.values())
