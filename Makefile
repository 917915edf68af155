# Both quickstart commands create (or reuse) a local virtualenv and install what they need.
# `-P` keeps the working directory off sys.path: the folder `operator/` here must never be imported in
# place of the standard library's `operator` module.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Type-check through the import names (the folder `operator/` would shadow the standard library).
TYPECHECK := build/typecheck

.PHONY: demo test lint typecheck pytest venv clean crds

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -P -m venv $(VENV)
	$(BIN)/python -P -m pip install -q --upgrade pip
	$(BIN)/python -P -m pip install -q -e '.[engine,operator,local,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ember demo

test: $(STAMP)
	$(MAKE) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	mkdir -p $(TYPECHECK)
	ln -sfn ../../engine $(TYPECHECK)/ember_engine
	ln -sfn ../../operator $(TYPECHECK)/ember_operator
	ln -sfn ../../e2e $(TYPECHECK)/ember_e2e
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p ember_engine -p ember_operator -p ember_e2e

pytest: $(STAMP)
	$(BIN)/pytest -q

crds: $(STAMP)
	$(BIN)/python -P -m ember_operator.crd > crds/inferenceservice.yaml

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
