PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The project alone (what `make demo` and `make dev` need), then the test and engine extras.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: test lint demo bench dev clean focus-validator

# vLLM and xgrammar without their dependencies: the `vllm` extra lists what the scheduler
# imports, and their full requirements would add a CUDA torch, flashinfer and triton.
VLLM_NO_DEPS := vllm==0.33.0 xgrammar==0.2.8
# The other supported vLLM release, beside the venv's, for the conformance test.
VLLM_NEXT := $(VENV)/vllm-0.34
VLLM_NEXT_STAMP := $(VLLM_NEXT)/.installed
VLLM_TESTS := tests/pipeline/hook/test_vllm_conformance.py tests/pipeline/hook/test_vllm_adapter.py
# SGLang beside the venv, for its conformance test, with only what importing its scheduler
# needs: its full requirements pull a CUDA torch, flashinfer and its GPU kernels. triton and
# torchvision are imported by SGLang at import time (kept out of the venv: PyPI's torchvision
# is a CUDA build, and transformers would import it for the vLLM tests too).
SGLANG := $(VENV)/sglang-0.5.23
SGLANG_STAMP := $(SGLANG)/.installed
SGLANG_NO_DEPS := sglang==0.5.23 triton==3.9.0 torchvision==0.28.0 orjson==3.13.0 \
	ipython==9.18.1 traitlets==5.16.1 setproctitle==1.3.8 dill==0.4.1 sentencepiece==0.2.3 \
	compressed-tensors==0.20.1 gguf==0.19.0 loguru==0.7.3
SGLANG_TESTS := tests/pipeline/hook/test_sglang_conformance.py tests/pipeline/hook/test_sglang_adapter.py

# The FinOps FOCUS validator, in a venv of its own for the export's conformance test
# (tests/pipeline/finance/test_focus.py). It needs Python 3.12, which Debian 12 does not
# package: the machine's pyenv has one. It requires numpy below 2, and pyarrow 21 is the last
# release that runs on numpy 1. Without a Python 3.12 the test is skipped and says why.
FOCUS_VALIDATOR := $(VENV)/focus-validator
FOCUS_VALIDATOR_STAMP := $(FOCUS_VALIDATOR)/.installed
PYTHON312 ?= $(firstword $(wildcard /usr/bin/python3.12 /usr/local/bin/python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12))

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,vllm]'
	$(BIN)/pip install --quiet --no-deps $(VLLM_NO_DEPS)
	touch $(TEST_STAMP)

$(VLLM_NEXT_STAMP): $(TEST_STAMP)
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(VLLM_NEXT) vllm==0.34.0
	touch $(VLLM_NEXT_STAMP)

$(SGLANG_STAMP): $(TEST_STAMP)
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(SGLANG) $(SGLANG_NO_DEPS)
	touch $(SGLANG_STAMP)

$(FOCUS_VALIDATOR_STAMP): Makefile
ifeq ($(PYTHON312),)
	@echo "no Python 3.12 on this machine: the FOCUS validator test will be skipped"
else
	$(PYTHON312) -m venv $(FOCUS_VALIDATOR)
	$(FOCUS_VALIDATOR)/bin/pip install --quiet focus_validator==2.2.1 pyarrow==21.0.0
	touch $(FOCUS_VALIDATOR_STAMP)
endif

focus-validator: $(FOCUS_VALIDATOR_STAMP)

# -rs: a skipped test says why (the FOCUS validator's, without a Python 3.12).
# The suite runs in TEST_WORKERS processes, each test module whole in one of them (its module
# fixtures built once): most of a module's time is its own subprocesses and servers waiting on
# each other, so two workers keep two cores busy.
TEST_WORKERS ?= 2
test: $(TEST_STAMP) $(VLLM_NEXT_STAMP) $(SGLANG_STAMP) $(FOCUS_VALIDATOR_STAMP)
	PYTHONPATH=$(VLLM_NEXT) $(BIN)/pytest $(VLLM_TESTS)
	PYTHONPATH=$(SGLANG) $(BIN)/pytest $(SGLANG_TESTS)
	$(BIN)/pytest -rs -n $(TEST_WORKERS) --dist loadfile

# Ruff holds complexity (C901); tests/test_code_shape.py holds function length, which ruff
# does not measure.
lint: $(TEST_STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	# What ruff and mypy cannot see: function length, the hook's imports, one home per unit,
	# the code map.
	$(BIN)/pytest -q -p no:warnings tests/test_code_shape.py tests/test_layering.py \
		tests/test_one_home.py tests/test_code_map.py

demo: $(STAMP)
	$(BIN)/stepledger demo

bench: $(TEST_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m benchmarks.run $(if $(QUICK),--quick)

dev: $(STAMP)
	$(BIN)/stepledger dev $(if $(DATA),--data $(DATA)) $(if $(PORT),--port $(PORT))

clean:
	rm -rf $(VENV) build *.egg-info
