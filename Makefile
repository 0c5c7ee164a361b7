# Everything runs from a virtual environment in .venv, created on first use.
# torch is pinned first so pip takes the CPU build from local disk instead of a CUDA download.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: install quickstart test test-fast lint benchmarks clean

$(BIN)/fsdp-bench: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,gp,hf,float8]'
	touch $@

install: $(BIN)/fsdp-bench

# Command 1 of the README: install, then run the built-in sweep on this machine's CPU.
quickstart: install
	$(BIN)/fsdp-bench sweep

lint: install
	$(BIN)/ruff check fsdp_bench tests benchmarks
	$(BIN)/ruff format --check fsdp_bench tests benchmarks
	$(BIN)/mypy

# Command 2 of the README: install everything (Python packages, and munge + Slurm from
# Debian packages for the testbed the Slurm tests start, chromium for the HTML report test,
# g++ for inductor's CPU code in the train.compile tests), lint, type-check, run every test.
test: lint
	slurm/testbed/install.sh
	command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }
	command -v g++ >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++; }
	$(BIN)/python -m pytest -n 2 -m "$(FAST)"
	$(BIN)/python -m pytest -m "not ($(FAST))"

# The tests that need neither the Slurm testbed, a browser, a GPU nor long multi-process runs.
# They run two at a time (pytest-xdist: 2:26-2:30 instead of about 3:30 on 2 cores, 2026-12-07);
# the others one at a time, since each is timed or marks runs that share the machine.
FAST := not slow and not slurm and not gpu

# The edit loop's lane (about 3 minutes on 2 cores): lint, type-check and the fast tests.
# `make test` still runs everything.
test-fast: lint
	$(BIN)/python -m pytest -n 2 -m "$(FAST)"

benchmarks: install
	$(BIN)/python benchmarks/harness_overhead.py
	$(BIN)/python benchmarks/orchestration_overhead.py
	$(BIN)/python benchmarks/slurm_overhead.py
	$(BIN)/python benchmarks/estimate_accuracy.py
	$(BIN)/python benchmarks/estimate_vs_published.py
	$(BIN)/python benchmarks/search_efficiency.py
	$(BIN)/python benchmarks/ranking_stability.py   # 20 minutes

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
