# Both quickstart commands create (or reuse) a local virtualenv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-engine test lint typecheck pytest venv clean crds dev-up dev-down

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[engine,operator,router,local,dev]'
	touch $(STAMP)

# The operator end to end on the local control plane (README: Quickstart); kubectl is used where it is on
# PATH, the Kubernetes Python client (installed here) otherwise.
demo: $(STAMP)
	$(BIN)/ember demo

# The engine alone: `ember serve` on the packaged model pair with speculative decoding.
demo-engine: $(STAMP)
	$(BIN)/ember demo-engine

# The local control plane (README: "Try it without a cluster"); DEV_ARGS passes options, e.g. --nodes 2.
dev-up: $(STAMP)
	$(BIN)/ember dev up $(DEV_ARGS)

dev-down: $(STAMP)
	$(BIN)/ember dev down $(DEV_ARGS)

test: $(STAMP)
	$(MAKE) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy -p ember_engine -p ember_operator -p ember_localcluster -p ember_router

# Two workers, each test module whole on one of them (its module-scoped control plane, server or engine
# starts once). `--dist loadfile`, not loadgroup: on pytest 9.2 loadgroup ignores xdist_group marks.
# Modules are handed out in collection order, the longest first (tests/conftest.py: LONGEST_FIRST).
pytest: $(STAMP)
	$(BIN)/pytest -q --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

crds: $(STAMP)
	$(BIN)/python -m ember_operator.crd > crds/inferenceservice.yaml

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
