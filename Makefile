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

test: lint
	$(BIN)/python -m pytest

test-fast: lint
	$(BIN)/python -m pytest -m "not slow"

# Rewrite the README's and docs/' result tables from the committed files under results/
results-docs: $(STAMP)
	$(BIN)/symalign docs

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
