PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint demo bench dev clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test]'
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
	$(BIN)/stepledger dev $(if $(DATA),--data $(DATA)) $(if $(PORT),--port $(PORT))

clean:
	rm -rf $(VENV) build *.egg-info
