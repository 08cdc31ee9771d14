# All set-up happens here: `make demo` or `make test` on a fresh clone creates .venv and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-heavy bench lint clean

$(BIN)/spec-convert: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/spec-convert

# The benchmarks' extra: scikit-learn for coremltools' k-means and coreai-opt (bench/quant_lut.py's comparisons).
$(VENV)/.bench: pyproject.toml $(BIN)/spec-convert
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

demo: install
	$(BIN)/spec-convert demo

# a worker per core (pytest-xdist), each module's tests on one worker so its fixtures are built once, the longest
# modules handed out first (tests/conftest.py LONGEST_FIRST)
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

test-heavy: install
	$(BIN)/python -m pytest -q -m heavy

bench: $(VENV)/.bench  # every benchmark the README names, with its defaults (CPU)
	$(BIN)/python -m bench.coreai_runtime
	$(BIN)/python -m bench.gates
	$(BIN)/python -m bench.hybrid_state
	$(BIN)/python -m bench.quant_lut
	$(BIN)/python -m bench.quant_gptq
	$(BIN)/python -m bench.quant_affine

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf build bundles .pytest_cache
