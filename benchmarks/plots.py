"""PNG charts of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from benchmarks.latency import LatencyRun
    from benchmarks.offline import OfflineRun
    from benchmarks.serve_run import ServeRun


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_offline(runs: list[OfflineRun], title: str, path: Path) -> Path:
    """Output tokens/s per run, and median TTFT where the run has one."""
    with_ttft = [r for r in runs if not math.isnan(r.summary.ttft_s.p50)]
    fig, axes = plt.subplots(
        1, 2 if with_ttft else 1, figsize=(10 if with_ttft else 6, 3.2), squeeze=False
    )
    ax = axes[0][0]
    bars = ax.barh(
        [r.label for r in runs], [r.summary.output_throughput for r in runs], color="tab:blue"
    )
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.invert_yaxis()
    ax.margins(x=0.2)
    if with_ttft:
        ax = axes[0][1]
        bars = ax.barh(
            [r.label for r in with_ttft],
            [r.summary.ttft_s.p50 for r in with_ttft],
            color="tab:orange",
        )
        ax.bar_label(bars, fmt="%.2f s", padding=3)
        ax.set_xlabel("median TTFT, s (lower is better)")
        ax.invert_yaxis()
        ax.margins(x=0.25)
    fig.suptitle(title)
    return _save(fig, path)


def plot_latency(runs: list[LatencyRun], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        ax.plot(
            [p.batch for p in run.decode],
            [p.tokens_per_s for p in run.decode],
            marker="o",
            label=run.label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("decode tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Decode throughput vs batch size")
    return _save(fig, path)


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_serve(runs: list[ServeRun], out_dir: Path) -> list[Path]:
    """Throughput and latency vs request rate, one line per server label (rates on a categorical
    axis)."""
    rates = sorted({r.request_rate for r in runs})
    x = {rate: i for i, rate in enumerate(rates)}
    labels = list(dict.fromkeys(r.label for r in runs))
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label in labels:
        mine = sorted((r for r in runs if r.label == label), key=lambda r: r.request_rate)
        ax.plot(
            [x[r.request_rate] for r in mine],
            [r.summary.output_throughput for r in mine],
            marker="o",
            label=label,
        )
    ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Serving throughput vs request rate")
    paths.append(_save(fig, out_dir / "serve_throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, metric, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for label in labels:
            mine = sorted((r for r in runs if r.label == label), key=lambda r: r.request_rate)
            xs = [x[r.request_rate] for r in mine]
            line, = ax.plot(xs, [getattr(r.summary, metric).p50 * 1e3 for r in mine], marker="o",
                            label=f"{label} p50")
            ax.plot(
                xs,
                [getattr(r.summary, metric).p99 * 1e3 for r in mine],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{label} p99",
            )
        ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name}, ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{name} vs request rate")
    paths.append(_save(fig, out_dir / "serve_latency.png"))
    return paths
