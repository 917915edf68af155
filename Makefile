# Both quickstart commands create (or reuse) a local virtualenv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GPTQ_TEST_PACKAGES := gptqmodel==7.7.0 optimum==2.3.0 pypcre==0.6.4 device-smi==0.5.7 logbar==0.4.15 \
	tokenicer==0.0.14 defuser==0.0.28 threadpoolctl==3.8.0

.PHONY: demo demo-engine test lint typecheck pytest venv clean crds dev-up dev-down

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[engine,operator,router,local,dev]'
	# GPTQModel writes the GPTQ test checkpoints and is the oracle that runs them (tests/gptq_build.py,
	# tests/gptq_oracle.py). Its metadata asks for newer torch and transformers than llm-compressor allows
	# and runs on these, so it and its small dependencies go in without their requirements, and without
	# CUDA kernels to build.
	BUILD_CUDA_EXT=0 $(BIN)/python -m pip install -q --no-deps --no-build-isolation $(GPTQ_TEST_PACKAGES)
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

# `ember dev down` shares only --dir with `ember dev up`: the rest of DEV_ARGS is left out.
dev-down: $(STAMP)
	set -- $(DEV_ARGS); args=""; \
	while [ $$# -gt 0 ]; do \
		case "$$1" in --dir) args="$$args --dir $$2"; shift ;; --dir=*) args="$$args $$1" ;; esac; shift; \
	done; \
	$(BIN)/ember dev down $$args

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
