# Two commands on a fresh machine (Python >= 3.10, network to PyPI only):
#   make demo   # install, build the embedded offline default corpus, validate it, print a summary
#   make test   # install, run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU wheel first: an unpinned torch can pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[filters,plot]"
	touch $(STAMP)

# What the tests need on top: test tools, transformers, Ray (pinned to the version the cluster
# tests were checked with; the extra has only a floor).
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[dev,filters,plot,cluster]" ray==2.60.0
	touch $(DEV_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/h5corpus build --validate

test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q

lint: $(DEV_STAMP)
	$(BIN)/ruff check h5corpus tests bench testkit
	$(BIN)/ruff format --check h5corpus tests bench testkit
	$(BIN)/lint-imports

bench: $(DEV_STAMP)
	for b in bench/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf shards/train shards/validation manifests/shards.json
