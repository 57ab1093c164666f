"""Markers by file, in one place.

`e2e`: whole jobs (a Slurm dev cluster, mpiexec runs of head + cells, whole rollouts). Each is
many processes and keeps ~1.5 cores busy, so `make test` runs them one at a time after the rest,
which runs in two pytest-xdist workers. `slow`: left out of `make test-fast` (every e2e test, and
unit tests that start a process stack for more than ~3 s).
"""

from __future__ import annotations

import pytest

E2E_FILES = {"test_slurm.py", "test_slurm_cells.py", "test_online.py", "test_cell_agent.py",
             "test_cell_agent_fault_phase.py", "test_megatron_dist.py", "test_rollout.py"}
# e2e tests that must share one pytest-xdist worker (`--dist loadgroup`): the dev cluster's tests
# (one cluster per machine: a second worker would wait on its lock), and a module-scoped job
# (test_cell_agent's `run`, started once for its ten tests)
XDIST_GROUPS = {"test_slurm.py": "slurm", "test_slurm_cells.py": "slurm", "test_cell_agent.py": "cell_agent"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in E2E_FILES:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
        if item.path.name in XDIST_GROUPS:
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUPS[item.path.name]))

