PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint demo bench dev clean

# vLLM and xgrammar without their dependencies: the `vllm` extra lists what the scheduler
# imports, and their full requirements would add a CUDA torch, flashinfer and triton.
VLLM_NO_DEPS := vllm==0.33.0 xgrammar==0.2.8

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test,vllm]'
	$(BIN)/pip install --quiet --no-deps $(VLLM_NO_DEPS)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/stepledger demo

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(if $(QUICK),--quick)

dev: $(STAMP)
	$(BIN)/stepledger dev

clean:
	rm -rf $(VENV) build *.egg-info
