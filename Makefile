# The README's first two commands: `make serve` and `make test`. Each sets up .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint setup

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

# The OpenAI-compatible server on 127.0.0.1:8000 (demo model by default); flags via ARGS='--model ... --tp 2'.
serve: $(STAMP)
	$(VENV)/bin/compiled-engine serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
