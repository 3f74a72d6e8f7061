# The two commands of the README:  make demo  and  make test.
# Both create (or reuse) the virtual environment .venv/ in the repository root.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test venv lint typecheck bench clickhouse-start clickhouse-stop clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 (CPU) installs from the local wheel on these machines; pinned so pip never
	# pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/ranklens demo $(ARGS)

# Unit, store (embedded and ClickHouse server) and end-to-end tests; scripts/test.sh starts a
# throw-away clickhouse-server when Debian's package is installed.
test: $(STAMP)
	scripts/test.sh $(PYTEST_ARGS)

# ruff, then mypy over every package under its installed module name (scripts/typecheck.py)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/typecheck.py

typecheck: $(STAMP)
	$(BIN)/python scripts/typecheck.py

bench: $(STAMP)
	$(BIN)/python bench/store_bench.py $(ARGS)

clickhouse-start:
	scripts/clickhouse.sh start

clickhouse-stop:
	scripts/clickhouse.sh stop

clean:
	rm -rf $(VENV) ranklens-store .pytest_cache .ruff_cache .mypy_cache *.egg-info
