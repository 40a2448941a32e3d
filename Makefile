# Every target bootstraps .venv itself; `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
CHECKED := dedupstore backends spark_integration
# pytest-xdist workers: the tests mostly wait on servers and subprocesses, so twice the
# cores of a 2-core machine; each worker starts its own servers (docs/contributing.md).
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 4
XDIST := -n $(TEST_WORKERS) --dist loadgroup
# make test-fast: no servers, no Spark, nothing marked slow (unit, memory and SQLite tests)
FAST_MARKERS := not (postgres or redis or dynamodb or cosmos or rabbitmq or spark or slow)

.PHONY: demo test test-fast docs lint format test-deps bench bench-tokens bench-aio bench-drivers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --editable '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	@command -v java >/dev/null 2>&1 || bash scripts/install-test-deps.sh java
	$(PY) -m dedupstore.spark.order_pipeline $(DEMO_ARGS)

test-deps:
	bash scripts/install-test-deps.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict $(CHECKED)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The docs site (docs/, Sphinx + furo + MyST): strict, every warning and unresolved
# reference fails the build. Output in docs/_build/html.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -n -b html docs docs/_build/html

test: $(STAMP) test-deps lint docs
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

bench: $(STAMP) test-deps
	$(PY) -m benchmarks.bench $(BENCH_ARGS)
	$(PY) -m benchmarks.spark_bench $(SPARK_BENCH_ARGS)

# The token-mode section alone (issue 38): replaces only its part of benchmarks/RESULTS.md.
bench-tokens: $(STAMP) test-deps
	$(PY) -m benchmarks.bench --only tokens $(BENCH_ARGS)

# The async face against threads (issue 39): replaces only its part of benchmarks/RESULTS.md.
bench-aio: $(STAMP) test-deps
	$(PY) -m benchmarks.bench --only aio $(BENCH_ARGS)

# Async drivers (aiobotocore, aiosqlite) against the offload on DynamoDB and SQLite: makes
# .venv-drivers for them (aiobotocore pins an older botocore) and replaces only its part
# of benchmarks/RESULTS.md. DRIVERS_ARGS: e.g. --writes 5000.
bench-drivers: $(STAMP)
	$(PY) -m benchmarks.aio_drivers $(DRIVERS_ARGS)

clean:
	rm -rf $(VENV) .venv-drivers docs/_build .dedupstore .pytest_cache .mypy_cache .ruff_cache node_modules
