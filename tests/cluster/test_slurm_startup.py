"""Start-up failures on a real multi-node Slurm (slurm/devcluster.sh): the het job ends within
seconds, its output says why in one line, and the allocation is given back (before, a wrong
model.path held it until its time limit). A process killed at its `start` fault phase
(gyre/faults.py; sbatch passes the environment to every step) ends the job the same way."""

from __future__ import annotations

import time

import pytest

from support.devcluster import _tail, cluster, sbatch, wait_gone  # noqa: F401  (cluster: a fixture)
from test_slurm import DEMO, ONE_CELL, sbatch_script

pytestmark = pytest.mark.timeout(600)


def test_wrong_model_path_ends_the_slurm_job_at_once(cluster, tmp_path):
    run, out = tmp_path / "run", tmp_path / "job.out"
    t0 = time.time()
    job = sbatch(cluster, ["-o", out, sbatch_script(tmp_path, nodes=1), DEMO, f"run.dir={run}", *ONE_CELL,
                           f"model.path={tmp_path / 'missing'}"])
    wait_gone(cluster, job, 60, out)
    took = time.time() - t0
    text = _tail(out)
    assert took < 30, (took, text)
    assert "configuration error: model.path" in text and "no such directory" in text, text
    assert "Traceback" not in text and not (run / "report.json").exists(), text


@pytest.mark.parametrize("process", ["head", "agent", "engine", "trainer"])
def test_a_process_that_dies_at_start_ends_the_slurm_job(cluster, tmp_path, process):
    run, out, faults = tmp_path / "run", tmp_path / "job.out", tmp_path / "faults"
    faults.mkdir()
    job = sbatch(cluster, ["-o", out, sbatch_script(tmp_path, nodes=1), DEMO, f"run.dir={run}", *ONE_CELL],
                 extra_env={"GYRE_FAULT": f"{process}:start", "GYRE_FAULT_DIR": str(faults)})
    wait_gone(cluster, job, 240, out)
    assert (faults / f"fired-{process}-start-1").exists(), _tail(out)
    assert not (run / "report.json").exists(), _tail(out)
