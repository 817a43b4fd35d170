# Quick start: `make demo` runs the default experiment, `make test` runs the test suite (fast tier;
# `make test-all` adds the tests marked slow).
# Both create the local virtual environment on first use (torch pinned by constraints.txt, which serves this
# Makefile and the tests; pyproject.toml itself pins nothing: docs/install.md).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1

.PHONY: demo test test-all test-slow bench-default clean-venv

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/clmerge run

test: $(STAMP)
	$(VENV)/bin/pytest -q

# -m on the command line replaces the default `-m 'not slow'` of pyproject's addopts.
test-all: $(STAMP)
	$(VENV)/bin/pytest -q -m "slow or not slow"

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

bench-default: $(STAMP)
	$(VENV)/bin/python benchmarks/default_run.py

clean-venv:
	rm -rf $(VENV)
