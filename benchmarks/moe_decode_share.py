"""The share of a batch-32 decode step spent in `kernels::fused_moe` on the `qwen3-moe` bench model:
torch's profiler over 20 decode steps (docs/benchmarks.md, "Qwen3-MoE")."""

import time

from torch.profiler import ProfilerActivity, profile

from benchmarks.models import QWEN3_MOE_NAME, bench_model_dir
from compiled_engine import LLM, SamplingParams

BATCH, STEPS = 32, 20


def main() -> None:
    llm = LLM(str(bench_model_dir(name=QWEN3_MOE_NAME)), num_pages=4096, max_running=64)
    prompts = [[(i * 37 + j) % 40000 + 10 for j in range(64)] for i in range(BATCH)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # warm
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.scheduler.waiting or any(r.planned_len < r.fill_to
                                          for r in engine.scheduler.running):
        engine.step()  # the prefills
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        wall = time.perf_counter() - t0
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    moe = totals.get("kernels::fused_moe", 0.0)
    print(f"batch {BATCH} decode: {wall / STEPS * 1e3:.1f} ms/step (profiled), fused_moe "
          f"{moe / STEPS * 1e3:.1f} ms/step = {moe / wall:.0%} of the step")
    while engine.has_work():
        engine.step()


if __name__ == "__main__":
    main()
