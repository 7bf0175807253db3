#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (#15; README "GPU check"). Every step runs under `timeout`, in
# about 9 minutes together, and the summary lands in $OUT/gpu_check.md (./gpu_check_out/ when OUT is unset),
# with the whole log and the benchmarks' JSON beside it:
#   kernels   the CUDA kernels against the reference (decode, extend, store; fp32, fp16, bf16; head dims
#             64-256; GQA 1-16; split-K and deterministic), a decode replayed in a CUDA graph
#   engine    greedy parity with transformers on the same GPU (graphs on/off, overlap on/off, fp32 and bf16),
#             zero compiles while serving, no host sync between launches
#   latency   decode step time with and without graphs (Qwen3-0.6B-shaped random model, batches 1 and 64)
#   host      host time per decode step against the GPU's kernel time, batch 64 (profiler)
#   offline   nano-vllm's workload (256 sequences, input and output lengths uniform in [100, 1024]) against
#             transformers generate on the same GPU
# Usage: scripts/gpu_check.sh [--dry-run]. Without a GPU it stops at once, saying so; --dry-run runs every step
# on the CPU at toy sizes (the demo model), to check the script itself. Wheels the GPU image lacks are
# installed from ./.whl when it is there (scripts/gpu_wheels.sh prepares it on a machine with an index).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$out"
summary="$out/gpu_check.md"
log="$out/gpu_check.log"
: >"$log"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export COMPILED_ENGINE_CACHE="${COMPILED_ENGINE_CACHE:-/tmp/compiled-engine-cache}"

if [ "$dry" = 0 ] && ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>>"$log"; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); this check needs a GPU." \
    "'scripts/gpu_check.sh --dry-run' runs its steps on the CPU." | tee "$summary" >&2
  exit 2
fi

# the wheels the GPU image lacks (after the GPU check: they are built for that image's Python)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
    .whl/*.whl >>"$log" 2>&1 || { echo "gpu_check: installing .whl failed (see $log)" | tee "$summary"; exit 3; }
  export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

unset TRITON_INTERPRET  # the CUDA kernels compile for the GPU (the CPU suite interprets them)
if [ "$dry" = 1 ]; then
  device=cpu model=demo batches=1,4 host_batch=4 steps=5 prompts=8 lengths=16:64 slower=5  # CPU compiles
else
  device=cuda model=qwen3-0.6b batches=1,64 host_batch=64 steps=50 prompts=256 lengths=100:1024 slower=1
fi

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)$([ "$dry" = 1 ] && echo ' (dry run on the CPU)')"
  echo
  "$py" - <<'EOF'
import platform, torch, triton, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"- {gpu}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__},"
      f" Python {platform.python_version()}")
EOF
  echo
  echo "| step | result | seconds | what it printed last |"
  echo "|---|---|---|---|"
} >"$summary" 2>>"$log"

failed=0
# step NAME SECONDS PATTERN COMMAND...: run COMMAND under `timeout`, log it, and add a summary row (the last
# output line matching PATTERN).
step() {
  local name=$1 limit=$(($2 * slower)) pattern=$3
  shift 3
  echo "=== $name: $*" >>"$log"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >"$out/.step" 2>&1
  rc=$?
  cat "$out/.step" >>"$log"
  local result=ok
  [ "$rc" = 0 ] || { result="FAILED (rc $rc)"; failed=1; }
  [ "$rc" = 124 ] && result="TIMEOUT after ${limit}s"
  # On a GPU a test step must have run something: its tests all skipping (no CUDA seen, a missing package) fails.
  if [ "$rc" = 0 ] && [ "$dry" = 0 ] && [[ " $* " == *" pytest "* ]] && ! grep -qE "[0-9]+ passed" "$out/.step"; then
    result="FAILED (no test passed: all skipped)"
    failed=1
  fi
  local last
  last=$(grep -E "$pattern" "$out/.step" | tail -n 3 | tr '\n|' '; ' | cut -c1-400)
  echo "| $name | $result | $((SECONDS - t0)) | ${last:-} |" >>"$summary"
  rm -f "$out/.step"
}

step kernels 90 "passed|failed|skipped" "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_cuda.py
step engine 170 "passed|failed|skipped|logprob error" "$py" -m pytest -q -s -p no:cacheprovider \
  tests/engine/test_cuda_engine.py
step latency 150 "faster" "$py" -m cli bench latency --model "$model" --device "$device" \
  --batch "$batches" --input-len 128 --output-len 64 --compare eager --json "$out/latency.json"
step host 40 "host" "$py" -m benchmarks.host_time --model "$model" --device "$device" \
  --batch "$host_batch" --steps "$steps" --json "$out/host_time.json"
step offline 200 "x output" "$py" -m cli bench offline --model "$model" --device "$device" \
  --num-prompts "$prompts" --input-len "$lengths" --output-len "$lengths" --compare hf --json "$out/offline.json"

echo >>"$summary"
echo "Full log: gpu_check.log; benchmark results: latency.json, host_time.json, offline.json." >>"$summary"
cat "$summary"
exit "$failed"
