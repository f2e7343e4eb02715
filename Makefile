# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Python writes the bytecode of what it imports, once. An environment that sets
# PYTHONDONTWRITEBYTECODE (CI's does) makes every process compile jax, torch and typer from
# source again: `import jax` took 8.2 s of CPU instead of 4.2 s, `marduk --help` 2.6 s instead
# of 1.4 s, and the suite starts hundreds of such processes on 2 cores.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test lint typecheck pytest pytest-fast test-unit test-integration test-e2e bench bench-restart bench-goodput bench-torchft bench-membership clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# --no-compile: Python compiles what it imports, when first imported; pip would compile
	# all of torch and jax up front (half a minute of CPU on a fresh machine).
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

## Start the controller on the embedded NATS server (nats://localhost:4222 unless MARDUK_ADDR says otherwise).
run: $(STAMP)
	$(VENV)/bin/marduk controller

## Lint, type-check and run the whole suite, end-to-end tests included. The suite mostly waits
## (servers, processes), so lint and mypy run beside it; their output comes whole, when done.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint typecheck & checks=$$!; \
	$(MAKE) --no-print-directory pytest; tests=$$?; \
	wait $$checks; checked=$$?; \
	if [ $$checked -ne 0 ]; then echo "make test: lint or typecheck failed (above)"; fi; \
	exit $$(( tests != 0 || checked != 0 ))

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tools/longest.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## Two phases: every test not marked serial on PYTEST_WORKERS pytest-xdist workers, then the
## tests marked serial (an upper bound on time, the machine-wide pid counter) one at a time.
## The suite mostly waits (servers, leases, graces, processes starting): on 2 cores 4 workers
## finish in a fraction of the serial time. tests/conftest.py keeps the files that run jax
## meshes, torch ranks or torchft groups to one worker per kind (--dist loadgroup; collected
## first, so they start first), and test ports never collide (tests/ports.py). 0 runs the
## first phase in one process. SUITE names a tier, MARKS narrows further (make pytest-fast,
## test-*); pytest's exit 5 (no test in a phase) is not a failure.
PYTEST_WORKERS ?= 4
SUITE ?= tests
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider --dist loadgroup --durations=25
ALSO := $(if $(MARKS), and ($(MARKS)))
OK5 := rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
pytest: $(STAMP)
	$(PYTEST) -n $(PYTEST_WORKERS) -m "not serial$(ALSO)" $(SUITE); $(OK5)
	$(PYTEST) -n 0 -m "serial$(ALSO)" $(SUITE); $(OK5)

## Everything but the slow end-to-end tests.
pytest-fast:
	@$(MAKE) --no-print-directory pytest MARKS="not e2e"

## The tiers, one folder each (tests/conftest.py): unit is the inner loop (no process, no socket).
test-unit: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit

test-integration:
	@$(MAKE) --no-print-directory pytest SUITE=tests/integration

test-e2e:
	@$(MAKE) --no-print-directory pytest SUITE=tests/e2e

bench: $(STAMP)
	$(PY) bench/bench_notify.py

## Restart/ready side by side with torchrun (installs the CPU build of torch into .venv).
bench-restart: $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) bench/bench_restart.py --trials 10

## Goodput (ETTR) under injected failures, Marduk against restart-all (~9 min; installs matplotlib).
bench-goodput: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) bench/bench_goodput.py --plot docs/img/goodput.png

## torchft alone (torchrun restart loop) against torchft under Marduk, four lighthouse timer
## settings, and under Marduk behind `marduk torchft-lighthouse`, device failures, crashes and
## hangs (~35 min; torch and torchft come with the dev
## extra). The tightest timers' 5-minute quiet run: bench/bench_torchft.py --configs
## alone-hb500-join100-tick20 --trials 0 --quiet 300.
bench-torchft: $(STAMP)
	$(PY) bench/bench_torchft.py --trials 3 --quiet 60 --out bench/results/torchft.json

## A member out of service -> every rank stepping again: in-place restart, spare swap and shrink
## of the 2-process jax.distributed mesh; shrink and grow of a torch gloo job, Marduk against
## torchrun --nnodes 1:2 (~12 min: three dampings; torch and jax come with the dev extra).
bench-membership: $(STAMP)
	$(PY) bench/bench_membership.py --trials 3 --out bench/results/membership.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
