# Quickstart targets. Each creates .venv when missing and installs every distribution in editable mode.
#   PYTHON=python3.X      interpreter used to create the venv (3.10+)
#   TORCH_SPEC=...        torch requirement installed first (default torch==2.13.0)
#   PYTEST_ARGS=...       extra arguments for pytest (`make test`, `make test-all`)
#   ALLOW_NO_TESTS=1      a selection that collects no tests (pytest exit 5) passes instead of failing
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.omnicore-installed
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
PYTEST_ARGS ?=
ALLOW_NO_TESTS ?= 0

.PHONY: install lint test test-slow test-all test-isolation serve bench gpu-check clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "omnicore needs Python 3.10+; set PYTHON=python3.X")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python core/pyproject.toml $(wildcard plugins/*/pyproject.toml) Makefile
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e "core[serve,test,quantization,postgres]" $(addprefix -e ,$(PLUGIN_DIRS))
	@# the playground's browser tests drive Debian's chromium (never a browser Playwright downloads); as root with
	@# apt-get it is installed here, elsewhere those tests skip with one line
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	  echo "installing Debian's chromium for the playground's browser tests"; \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) > /dev/null \
	  || echo "warning: could not install chromium; the playground's browser tests will skip" >&2; \
	fi
	@# the job store's PostgreSQL tests start a throwaway server from Debian's postgresql (initdb + pg_ctl); as
	@# root with apt-get it is installed here when no server binaries exist, elsewhere those tests skip with one line
	@if ! ls /usr/lib/postgresql/*/bin/initdb > /dev/null 2>&1 && ! command -v initdb > /dev/null \
	    && [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	  echo "installing Debian's postgresql for the job store's PostgreSQL tests"; \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql) > /dev/null \
	  || echo "warning: could not install postgresql; the PostgreSQL job-store tests will skip" >&2; \
	fi
	@touch $(STAMP)

install: $(STAMP)

# pytest exits 5 when it collected nothing: on the whole suite that means the suite itself is broken.
define run_pytest
@$(BIN)/python -m pytest $(1) $(PYTEST_ARGS); rc=$$?; \
if [ $$rc -eq 5 ]; then \
  if [ "$(ALLOW_NO_TESTS)" = 1 ]; then echo "make $@: no tests selected (pytest exit 5); allowed" >&2; exit 0; fi; \
  echo "make $@: pytest collected no tests (exit 5) with PYTEST_ARGS='$(PYTEST_ARGS)'; failing" >&2; \
fi; exit $$rc
endef

# Static checks, configured in pyproject.toml: ruff on core/ and plugins/, then mypy on the core and every plugin
# package under plugins/. `make test` and `make test-all` run them first, so CI does too.
lint: $(STAMP)
	$(BIN)/ruff check core plugins
	$(BIN)/mypy

# `make test`: the fast default, tests marked slow deselected (a few minutes on 2 cores).
test: $(STAMP) lint
	$(call run_pytest,-m "not slow")

# `make test-slow`: only the tests marked slow (CI runs it right after `make test`, so CI runs everything).
test-slow: $(STAMP)
	$(call run_pytest,-m slow)

# `make test-all`: everything in one pytest run, slow tests included.
test-all: $(STAMP) lint
	$(call run_pytest,)

# Each test directory alone, its files in reverse order: catches tests that depend on collection order.
test-isolation: $(STAMP)
	$(BIN)/python .ci/isolated.py

# `make serve`: the default tiny model (see `omnicore serve --help` for `auto`). Ctrl-C drains and ends it with
# exit 0; `exec` makes the server the recipe's process, so a signal sent to it needs no shell in between.
serve: $(STAMP)
	exec $(BIN)/omnicore serve auto

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The prepared GPU check (benchmarks/gpu_check.sh): on a CUDA machine, a fresh venv over the machine's torch, the CUDA
# tests compiled for real, the GPU benchmarks, one JSON + markdown report. GPU_CHECK_ARGS=--dry checks its plumbing.
GPU_CHECK_ARGS ?=
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build core/build plugins/*/build
