#!/usr/bin/env bash
# `make test`: the whole suite, then the kernels' invariance tests and the parity tests again at each
# COMPILED_ENGINE_CPU_ISA level below the one asked for (native by default) that changes a layer's choice (kernels.cpu.isa.plan: on an
# AMX CPU avx512 and avx2, on an AVX512 one avx2, none on an AVX2-only or ARM CPU, which runs the portable
# paths natively). The portable level (avx2) reruns the parity tests all but SmolLM2 in --no-deterministic
# mode (the random checkpoints run that mode there, SmolLM2 the deterministic default); an intermediate one
# (avx512 on an AMX CPU) the random checkpoints only: SmolLM2's cold compile per mode and level would take
# the suite past its time budget. Every run runs even when one before it failed; the end names the runs
# that failed and exits with the first failure's status.
set -uo pipefail
trap 'echo "== make test: interrupted" >&2; exit 130' INT  # Ctrl-C stops every run, not only pytest's
py=${PY:-.venv/bin/python}
eval "args=(${PYTEST_ARGS:-})"  # the shell's quoting: PYTEST_ARGS='-m "not slow"' is two words
failed=() status=0
run() {  # run NAME COMMAND...
  "${@:2}"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    failed+=("$1 (exit $rc)")
    [ "$status" -ne 0 ] || status=$rc
  fi
}
run "the suite" "$py" -m pytest -q --durations=50 "${args[@]}"
levels=$("$py" -c 'from kernels.cpu import isa; print(*isa.levels_below_native())') || {
  failed+=("listing the ISA levels"); [ "$status" -ne 0 ] || status=1; levels=""; }
for isa in $levels; do
  select="not (smollm2 and fast)"
  [ "$isa" = avx2 ] || select="not smollm2"
  echo "== invariance and parity tests with COMPILED_ENGINE_CPU_ISA=$isa${select:+ (-k '$select')}"
  run "$isa invariance" env COMPILED_ENGINE_CPU_ISA="$isa" "$py" -m pytest -q "${args[@]}" \
    tests/kernels/test_kernels_invariant.py tests/kernels/test_lora_kernel.py
  run "$isa parity" env COMPILED_ENGINE_CPU_ISA="$isa" "$py" -m pytest -q -m parity -k "$select" "${args[@]}" \
    tests/parity tests/lora/test_lora_parity.py
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "== make test: failed runs: $(IFS=';'; echo "${failed[*]}")"
else
  echo "== make test: every run passed"
fi
exit "$status"
