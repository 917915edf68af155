# Both quickstart commands create (or reuse) a local virtualenv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest venv clean crds

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[engine,operator,router,local,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ember demo

test: $(STAMP)
	$(MAKE) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy -p ember_engine -p ember_operator -p ember_localcluster -p ember_router

pytest: $(STAMP)
	$(BIN)/pytest -q

crds: $(STAMP)
	$(BIN)/python -m ember_operator.crd > crds/inferenceservice.yaml

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
