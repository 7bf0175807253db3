#!/usr/bin/env bash
# `make test`: the whole suite, then the kernels' invariance tests and the parity tests again at each
# COMPILED_ENGINE_CPU_ISA level below this CPU's that changes a layer's choice (kernels.cpu.isa.plan: on an
# AMX CPU avx512 and avx2, on an AVX512 one avx2, none on an AVX2-only or ARM CPU, which runs the portable
# paths natively). The portable level (avx2) reruns the parity tests all; an intermediate one (avx512 on an
# AMX CPU) the random checkpoints only: SmolLM2's cold compile per level would take the suite past its time
# budget. Every run runs even when one before it failed; the end names the runs that failed and exits with
# the first failure's status.
set -uo pipefail
py=${PY:-.venv/bin/python}
read -r -a args <<<"${PYTEST_ARGS:-}"
failed=() status=0
run() {  # run NAME COMMAND...
  "${@:2}"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    failed+=("$1 (exit $rc)")
    [ "$status" -ne 0 ] || status=$rc
  fi
}
run "the suite" "$py" -m pytest -q --durations=20 "${args[@]}"
for isa in $("$py" -c 'from kernels.cpu import isa; print(*isa.levels_below_native())'); do
  select=""
  [ "$isa" = avx2 ] || select="not smollm2"
  echo "== invariance and parity tests with COMPILED_ENGINE_CPU_ISA=$isa${select:+ (-k '$select')}"
  run "$isa invariance" env COMPILED_ENGINE_CPU_ISA="$isa" "$py" -m pytest -q "${args[@]}" \
    tests/kernels/test_kernels_invariant.py
  run "$isa parity" env COMPILED_ENGINE_CPU_ISA="$isa" "$py" -m pytest -q -m parity -k "$select" "${args[@]}" \
    tests/parity
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "== make test: failed runs: $(IFS=';'; echo "${failed[*]}")"
else
  echo "== make test: every run passed"
fi
exit "$status"
