# All set-up happens here: `make demo` or `make test` on a fresh clone creates .venv and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-heavy lint clean

$(BIN)/spec-convert: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/spec-convert

demo: install
	$(BIN)/spec-convert demo

test: install
	$(BIN)/python -m pytest -q

test-heavy: install
	$(BIN)/python -m pytest -q -m heavy

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf build bundles .pytest_cache
