"""`python -m benchmarks.host_time`: the host's time per decode step against the
device's, at one batch size (#15's target on a GPU: host under 10% of the GPU step at batch 64).

The host's part of a step is `Engine.step` minus its wait for the previous step's tokens (under
overlap the device runs the next step meanwhile); the device's part is the kernel time the profiler
records over the same number of steps, per step. Both are measured over `--steps` steady decode
steps of a full batch: first unprofiled (host and wall time), then profiled (kernel time).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.engine_run import build_llm, close_llm
from benchmarks.models import BENCH_NAME, resolve_bench_model
from compiled_engine.runner import model_runner
from compiled_engine.sampling_params import SamplingParams


@dataclass
class HostTime:
    device: str
    batch: int
    steps: int
    wall_ms: float  # per step
    host_ms: float  # per step: Engine.step minus the wait for tokens
    wait_ms: float
    kernel_ms: float | None  # per step, from the profiler (None off CUDA)

    @property
    def host_share(self) -> float | None:
        return None if not self.kernel_ms else self.host_ms / self.kernel_ms


class _WaitClock:
    """Adds up the time `PendingStep.result` spends waiting, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._result = model_runner.PendingStep.result

    def __enter__(self) -> _WaitClock:
        clock, result = self, self._result

        def timed(step):
            t0 = time.perf_counter()
            try:
                return result(step)
            finally:
                clock.seconds += time.perf_counter() - t0

        model_runner.PendingStep.result = timed
        return self

    def __exit__(self, *exc) -> None:
        model_runner.PendingStep.result = self._result


def measure(model: str, device: str, batch: int, steps: int, input_len: int) -> HostTime:
    llm = build_llm(resolve_bench_model(model), device=device)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=2 * steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"host-time-{i}", [rng.randrange(3, 1000) for _ in range(input_len)], params
        )
    try:
        # prefill done, decode steady
        while engine.scheduler.stats().num_waiting or engine.steps < 8:
            engine.step()
        with _WaitClock() as wait:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - t0
        kernel_ms = None
        if engine.runner.device.type == "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    engine.step()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernel_ms = sum(e.device_time_total for e in kernels) / 1e3 / steps
        ms = 1e3 / steps
        return HostTime(
            str(engine.runner.device),
            batch,
            steps,
            wall * ms,
            (wall - wait.seconds) * ms,
            wait.seconds * ms,
            kernel_ms,
        )
    finally:
        close_llm(llm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=BENCH_NAME)
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = measure(args.model, args.device, args.batch, args.steps, args.input_len)
    share = result.host_share
    print(
        f"{result.device}, batch {result.batch}, {result.steps} decode steps: wall "
        f"{result.wall_ms:.3f} ms/step, host {result.host_ms:.3f} ms/step (waiting "
        f"{result.wait_ms:.3f}), kernels "
        + ("n/a" if result.kernel_ms is None else f"{result.kernel_ms:.3f} ms/step")
        + ("" if share is None else f"; host / kernels = {share:.1%}")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result) | {"host_share": share}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
