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

# Until the HTTP server lands, `make serve` runs the main job offline: prompt in, text out.
serve: $(STAMP)
	@echo "make serve: HTTP server not built yet; running offline generation on the demo model"
	$(VENV)/bin/compiled-engine generate $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
