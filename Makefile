# Gyre: every target does its own set-up on a fresh machine.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# CPU machines take the local CPU wheel; a GPU site sets TORCH_SPEC (e.g. TORCH_SPEC=torch==2.8.0).
TORCH_SPEC ?= torch==2.13.0
STAMP     := $(VENV)/.installed
PYTEST_ARGS ?=
# the unit tests run in JOBS pytest-xdist workers; the e2e tests (tests/conftest.py: whole jobs of
# many processes, ~1.5 cores each) run one at a time after them
JOBS      ?= 2
PYTEST    := PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -ra

.PHONY: install test test-fast demo bench bench-nl2repo clean-venv

$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev,mpich]'
	$(BIN)/gyre make-model
	touch $(STAMP)

install: $(STAMP)

# everything CI can run; both phases run, and either failing fails the target
# (pytest's 5, "no test selected", is fine: PYTEST_ARGS=-k may select from one phase only)
test: install
	@rc=0; \
	echo "== unit tests ($(JOBS) workers)"; \
	$(PYTEST) -n $(JOBS) -m "not e2e" --durations=10 $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	echo "== end-to-end tests (one at a time)"; \
	$(PYTEST) -m e2e --durations=15 $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	exit $$rc

# the unit tests: under 2 minutes on 2 cores; --durations names any test that grew slow
test-fast: install
	$(PYTEST) -n $(JOBS) -m "not slow" --durations=10 $(PYTEST_ARGS)

demo: install
	rm -rf runs/demo
	$(BIN)/gyre run --config launchers/demo.toml

bench: install
	@set -e; for b in benchmarks/bench_*.py; do \
	  case $$b in *_gpu.py) continue;; esac; \
	  echo "== $$b"; $(BIN)/python $$b; done

bench-nl2repo: install
	$(BIN)/python benchmarks/bench_nl2repo.py

clean-venv:
	rm -rf $(VENV)
