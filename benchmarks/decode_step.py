"""Compiled vs eager, side by side in one process:
`python -m benchmarks.decode_step`.

1. Demo model (fp32): decode step latency at batch 1/8/32 (context 128 per row), eager vs each
   compile mode.
2. Bench model (bf16 Llama, hidden 768, 12 layers): batch-1 decode tokens/s (prompt 128, 256 new
   tokens, greedy argmax on the logits) and 512-token prefill tokens/s, eager vs each compile mode.

It times the model step (`CompiledForward`, on graphs precompiled as the engine's warm-up makes
them), not the scheduler or the sampler. The machine may be shared: variants run interleaved, call
by call, and each estimate is the mean of the fastest fifth of the samples, in wall time and in CPU
time of this process (CPU time ignores the time other processes hold the cores; with --threads 1 it
is the cleanest signal on a busy machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kernels
from benchmarks.models import bench_model_dir
from compiled_engine.models.loader import load_model
from compiled_engine.runner.compiled_forward import COMPILE_MODES, CompiledForward
from compiled_engine.runner.model_runner import ModelRunner, RunnerConfig
from compiled_engine.runner.step_inputs import StepInputs, build_step_inputs
from compiled_engine.scheduler.plan import ReqStep, StepPlan

# A step's inputs, and its request count when it is a decode step (None: an extend).
Step = tuple[StepInputs, int | None]


class Setup:
    """One model and KV pool, an eager forward and one compiled forward per mode, all sharing
    them."""

    def __init__(
        self, model_dir: str, load_format: str, buckets: list[int], slots: int, modes: list[str]
    ) -> None:
        kernels.init(torch.device("cpu"))  # as the engine builder does: the native kernels
        self.model, _ = load_model(model_dir, load_format=load_format)
        self.runner = ModelRunner(
            self.model,
            RunnerConfig(
                max_rows=max(buckets) + 1,
                max_context=2048,
                page_size=1,
                num_pages=slots + 1,
                buckets=buckets,
                enforce_eager=True,
            ),
            torch.device("cpu"),
        )
        cpu = torch.device("cpu")
        self.forwards: dict[str, CompiledForward] = {
            "eager": CompiledForward(self.model, buckets, False, cpu)
        }
        self._precompiled = tempfile.TemporaryDirectory(prefix="bench-decode-")
        for mode in modes:
            self.forwards[mode] = CompiledForward(self.model, buckets, True, cpu, compile_mode=mode)
            # Precompiled, as the engine's warm-up makes the graphs it serves with.
            self.forwards[mode].precompiled_dir = Path(self._precompiled.name) / mode
        self.next_slot = 1

    def rows(self, lengths: list[int]) -> None:
        """Give row b a fresh run of `lengths[b]` KV slots in its page-table row."""
        for b, n in enumerate(lengths):
            self.runner.tables.page_table[b, :n] = torch.arange(
                self.next_slot, self.next_slot + n, dtype=torch.int32
            )
            self.next_slot += n

    def decode(self, positions: list[int], bucket: int) -> Step:
        """A decode step of one request per position, padded to `bucket` rows."""
        t = self.runner.tables
        reqs = tuple(
            ReqStep(f"r{b}", b, p, 1, (int(t.page_table[b, p]),), True)
            for b, p in enumerate(positions)
        )
        plan = StepPlan(0, reqs, (), (), True)
        return build_step_inputs(plan, t, bucket, self.runner.staging), len(reqs)

    def extend(self, length: int) -> Step:
        t = self.runner.tables
        reqs = (ReqStep("p", 0, 0, length, tuple(t.page_table[0, :length].tolist()), True),)
        plan = StepPlan(0, reqs, (), (), False)
        return build_step_inputs(plan, t, None, self.runner.staging), None


def _interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float]]:
    """name -> (wall s, CPU s): each the mean of the fastest fifth, the variants run call by call in
    turn."""
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)

    def est(v: list[float]) -> float:
        return statistics.mean(sorted(v)[: max(1, len(v) // 5)])

    return {k: (est(wall[k]), est(cpu[k])) for k in fns}


def _step(fwd: CompiledForward, step: Step) -> torch.Tensor:
    """One forward's logits, on the graph the engine would pick for it."""
    inputs, n_requests = step
    return fwd(inputs, None if n_requests is None else fwd.graph_for(n_requests))[0]


def _compile(fwd: CompiledForward, inputs: Step) -> float:
    t0 = time.perf_counter()
    _step(fwd, inputs)
    return time.perf_counter() - t0


def demo_decode(modes: list[str], batches: list[int], context: int, repeats: int) -> None:
    from compiled_engine.models.demo import demo_model_dir

    setup = Setup(str(demo_model_dir()), "auto", batches, max(batches) * context + 16, modes)
    setup.rows([context] * max(batches))
    print(f"\n## demo model (fp32), decode step latency, context {context} per row")
    print(
        f"{'batch':>5} {'variant':>22} {'compile s':>9} {'wall ms':>8} {'cpu ms':>8} "
        f"{'x eager (wall)':>14} {'x eager (cpu)':>13}"
    )
    with torch.inference_mode():
        for batch in batches:
            inputs = setup.decode([context - 1] * batch, batch)
            compile_s = {name: _compile(fwd, inputs) for name, fwd in setup.forwards.items()}
            res = _interleaved(
                {
                    name: (lambda f=fwd, x=inputs: _step(f, x))
                    for name, fwd in setup.forwards.items()
                },
                repeats,
            )
            ew, ec = res["eager"]
            for name, (w, c) in res.items():
                cs = "" if name == "eager" else f"{compile_s[name]:.1f}"
                print(
                    f"{batch:>5} {name:>22} {cs:>9} {w * 1e3:8.2f} {c * 1e3:8.2f} {ew / w:14.2f} "
                    f"{ec / c:13.2f}",
                    flush=True,
                )


def bench_model(modes: list[str], prompt: int, new_tokens: int, prefill: int, rounds: int) -> None:
    model_dir = str(bench_model_dir())
    setup = Setup(model_dir, "auto", [1], 2 * (prompt + new_tokens) + 2 * prefill + 16, modes)
    print(
        f"\n## bench model (bf16, {model_dir}): batch-1 decode (prompt {prompt}, {new_tokens} new "
        f"tokens) and a {prefill}-token prefill, tokens/s"
    )
    with torch.inference_mode():
        setup.rows([prompt + new_tokens])
        decode_steps = [setup.decode([p], 1) for p in range(prompt, prompt + new_tokens)]
        prompt_inputs = setup.extend(prompt)
        setup.rows([prefill])
        prefill_inputs = setup.extend(prefill)
        compile_s = {}
        for name, fwd in setup.forwards.items():
            compile_s[name] = (_compile(fwd, decode_steps[0]), _compile(fwd, prefill_inputs))

        def generate(fwd: CompiledForward) -> Callable[[], None]:
            def run() -> None:
                _step(fwd, prompt_inputs)
                for step in decode_steps:
                    _step(fwd, step).argmax(-1)
            return run

        # Decode: whole 256-step generations, variants in turn; the per-step estimate is the total
        # over steps.
        gen = _interleaved({name: generate(fwd) for name, fwd in setup.forwards.items()}, rounds)
        pre_only = _interleaved(
            {name: (lambda f=fwd: _step(f, prompt_inputs)) for name, fwd in setup.forwards.items()},
            3,
        )
        pre = _interleaved(
            {
                name: (lambda f=fwd: _step(f, prefill_inputs))
                for name, fwd in setup.forwards.items()
            },
            max(3, rounds),
        )
    print(f"{'variant':>22} {'compile s (decode/extend)':>25} {'decode tok/s wall':>17} {'cpu':>7} "
          f"{'x eager':>7} {'prefill tok/s wall':>18} {'cpu':>7} {'x eager':>7}")
    dec = {
        k: (
            new_tokens / max(1e-9, g[0] - pre_only[k][0]),
            new_tokens / max(1e-9, g[1] - pre_only[k][1]),
        )
        for k, g in gen.items()
    }
    pf = {k: (prefill / v[0], prefill / v[1]) for k, v in pre.items()}
    for name in setup.forwards:
        cs = "" if name == "eager" else f"{compile_s[name][0]:.1f} / {compile_s[name][1]:.1f}"
        print(
            f"{name:>22} {cs:>25} {dec[name][0]:17.1f} {dec[name][1]:7.1f} "
            f"{dec[name][1] / dec['eager'][1]:7.2f} {pf[name][0]:18.1f} {pf[name][1]:7.1f} "
            f"{pf[name][1] / pf['eager'][1]:7.2f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", default="default,freezing",
                    help=f"compile modes to compare ({', '.join(COMPILE_MODES)})")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument(
        "--repeats", type=int, default=60, help="decode steps timed per variant and batch (demo)"
    )
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument(
        "--rounds", type=int, default=3, help="timed generations per variant (bench model)"
    )
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; modes: "
        + ", ".join(f"{m}={COMPILE_MODES[m]}" for m in modes)
    )
    if not args.skip_demo:
        demo_decode(modes, [int(b) for b in args.batches.split(",")], args.context, args.repeats)
    if not args.skip_bench:
        bench_model(modes, args.prompt, args.new_tokens, args.prefill, args.rounds)


if __name__ == "__main__":
    main()
