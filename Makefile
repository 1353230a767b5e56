# Two commands on a fresh machine (Python >= 3.10, network to PyPI only):
#   make demo   # install, build the embedded offline default corpus, validate it, print a summary
#   make test   # install, run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU wheel first: an unpinned torch can pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# ray pinned to the version the cluster tests were checked with (the extra has only a floor).
	$(BIN)/pip install -q -e ".[dev,filters,plot,cluster]" ray==2.60.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/h5corpus build --validate

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check h5corpus tests bench
	$(BIN)/ruff format --check h5corpus tests bench
	$(BIN)/lint-imports

bench: $(STAMP)
	for b in bench/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf shards/train shards/validation manifests/shards.json
