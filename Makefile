# Quickstart targets. Each creates .venv when missing and installs every distribution in editable mode.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.omnicore-installed
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
PYTEST_ARGS ?=

.PHONY: install test serve bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "omnicore needs Python 3.10+; set PYTHON=python3.X")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python core/pyproject.toml $(wildcard plugins/*/pyproject.toml) Makefile
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e "core[serve,test]" $(addprefix -e ,$(PLUGIN_DIRS))
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/omnicore serve auto

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build core/build plugins/*/build
