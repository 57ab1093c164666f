# Gyre: every target does its own set-up on a fresh machine.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# CPU machines take the local CPU wheel; a GPU site sets TORCH_SPEC (e.g. TORCH_SPEC=torch==2.8.0).
TORCH_SPEC ?= torch==2.13.0
STAMP     := $(VENV)/.installed
PYTEST_ARGS ?=
# end-to-end files (a Slurm dev cluster, mpiexec runs of head + cells, whole rollouts): make test
# runs them; test-fast leaves them and every test marked slow (> ~10 s) out
E2E_TESTS := tests/test_slurm.py tests/test_online.py tests/test_cell_agent.py \
             tests/test_megatron_dist.py tests/test_rollout.py

.PHONY: install test test-fast demo bench bench-nl2repo clean-venv

$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev,mpich]'
	$(BIN)/gyre make-model
	touch $(STAMP)

install: $(STAMP)

test: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

# the unit tests: under 2 minutes on 2 cores; --durations names any test that grew slow
test-fast: install
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -ra -m "not slow" \
	  $(addprefix --ignore=,$(E2E_TESTS)) --durations=10 $(PYTEST_ARGS)

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
