PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo lint test test-fast bench results-docs clean

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,hf,ray]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/symalign demo

# the linter (ruff, config in pyproject.toml) and the import-layer contracts run before the tests
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports

# one pytest worker per core (pytest-xdist; at most 8), each at one torch thread (tests/conftest.py), a test
# file per worker at a time: on 2 cores the suite takes ~13 min instead of ~22
PYTEST := $(BIN)/python -m pytest -n auto --maxprocesses 8 --dist loadfile

test: lint
	$(PYTEST)

test-fast: lint
	$(PYTEST) -m "not slow"

# Rewrite the README's and docs/' result tables from the committed files under results/
results-docs: $(STAMP)
	$(BIN)/symalign docs

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
