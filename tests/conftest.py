"""Markers by file, and the order `make test` hands tests to its workers, in one place.

`e2e`: whole jobs (a Slurm dev cluster, mpiexec runs of head + cells, whole rollouts). Each is
many processes. `make test` runs every test in one pytest run of cores + 1 workers (`--dist
loadgroup`): the groups below first (pytest-xdist sends the largest scopes first), then the other
whole jobs, then the unit tests, which fill the workers to the end, so none waits idle on another's
last long job. `slow`: left out of `make test-fast` (every e2e test, and unit tests that start a
process stack for more than ~3 s).
"""
from __future__ import annotations

import pytest

E2E_FILES = {"test_slurm.py", "test_slurm_cells.py", "test_online.py", "test_cell_agent.py",
             "test_cell_agent_fault_phase.py", "test_megatron_dist.py", "test_rollout.py", "test_slurm_startup.py"}
# e2e tests that must share one pytest-xdist worker: the dev cluster's tests (one cluster per
# machine: a second worker would wait on its lock), and test_cell_agent's module-scoped job
# (started once for its ten tests)
XDIST_GROUPS = {"test_slurm.py": "slurm", "test_slurm_cells.py": "slurm", "test_slurm_startup.py": "slurm",
                "test_cell_agent.py": "cell_agent",
                "test_online_resume.py": "online_resume",  # one run in three sessions, shared by its tests
                "test_online_head_faults.py": "head_faults",  # one run in four jobs, shared by its tests
                "test_vllm_engine.py": "vllm"}  # its vLLM server once for the module


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in E2E_FILES:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
    if config.getvalue("dist") == "loadgroup":  # whole jobs first, each file's order kept (a stable sort)
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` by XDIST_GROUPS, each other test on its own. Not xdist_group marks:
    pytest-xdist 3.8 groups by a suffix it writes to ``item._nodeid``, which pytest 9 no longer
    reads (its nodeid is ``item._id``), so marked tests were spread over both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return XDIST_GROUPS.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], nodeid)

    return ByGroup(config, log)
