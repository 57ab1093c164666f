"""Deaths at named phases of a cell (gyre.faults): the run still trains every step once.

Each test is one `gyre run` (1 head + 2 cells, scheme C so that both cells train and reduce
together) with ``GYRE_FAULT=<process>:<phase>``: the first process that reaches the phase SIGKILLs
itself there, once (a marker file in ``GYRE_FAULT_DIR`` proves it fired and stops a restarted
process from dying again). Nothing waits on a sleep: the kill happens exactly at the phase.

Checked: the fault fired; every step closed exactly once (steps.jsonl) and the run reached its
last version; ledger.jsonl trains each execution at most once and records every other ended
execution with a reason; the right recovery ran (a trainer restart, and for deaths between the
sum and the commit a repeated reduce).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_online import check_ledger, gyre_run, report  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# the smallest run in which both cells train and reduce together at every step
# (test_online's SMALL run: a step whose executions all got the same reward has nothing to train,
# and a colocated pool then never switches; 2 groups of 4 avoid that)
TINY = ["sched.cells=2", "sched.scheme=C", "sched.staleness=0", "train.micro_batch_tokens=256"]


def faulted_run(tmp_path: Path, spec: str, *, steps: int = 2, resume: bool = False):
    run_dir = tmp_path / "run"
    env_before = {k: os.environ.get(k) for k in ("GYRE_FAULT", "GYRE_FAULT_DIR")}
    os.environ["GYRE_FAULT"], os.environ["GYRE_FAULT_DIR"] = spec, str(tmp_path)
    try:
        rc, out = gyre_run(run_dir, *TINY, steps=steps, resume=resume)
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run_dir, rc, out


def steps_closed(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "steps.jsonl").read_text().splitlines() if x.strip()]


def assert_recovered(tmp_path: Path, run_dir: Path, rc: int, out: str, process: str, phase: str) -> dict:
    assert (tmp_path / f"fired-{process}-{phase}-1").exists(), f"the fault {process}:{phase} never fired\n{out[-3000:]}"
    assert rc == 0, out[-4000:]
    rep = report(run_dir)
    assert rep["version"] == 2 and not rep["errors"], rep["errors"]
    assert sorted(steps_closed(run_dir)) == [0, 1]  # each step closed once
    check_ledger(run_dir)
    return rep


@pytest.mark.parametrize("phase", ["micro_batch", "prepare_reduce"])
def test_trainer_fault_phase_before_the_sum_requeues_the_lost_micro_batches(tmp_path, phase):
    run_dir, rc, out = faulted_run(tmp_path, f"trainer:{phase}")
    rep = assert_recovered(tmp_path, run_dir, rc, out, "trainer", phase)
    restarts = [e for e in rep["events"] if e["kind"] == "trainer_restarted"]
    assert restarts and restarts[0]["info"]["lost"], restarts  # its gradients were handed out again


@pytest.mark.parametrize("phase", ["reduce", "optimizer_step", "export", "checkpoint"])
def test_trainer_fault_phase_before_the_commit_repeats_the_reduce(tmp_path, phase):
    run_dir, rc, out = faulted_run(tmp_path, f"trainer:{phase}")
    rep = assert_recovered(tmp_path, run_dir, rc, out, "trainer", phase)
    assert any(e["kind"] == "trainer_restarted" for e in rep["events"])
    retries = [e for e in rep["events"] if e["kind"] == "reduce_retry"]
    assert retries, "the step was not reduced again"
    # the weights of the last version are complete (a death in export left no half directory)
    assert (run_dir / "weights" / "v2" / "config.json").exists()


def test_agent_fault_phase_command_resumes_from_the_last_checkpoint(tmp_path):
    run_dir, rc, out = faulted_run(tmp_path, "agent:command:3")
    assert (tmp_path / "fired-agent-command-3").exists(), out[-3000:]
    assert rc != 0  # an agent is an MPI rank: its death ends the job
    cells = json.loads((run_dir / "cells.json").read_text())["cells"] if (run_dir / "cells.json").exists() else []
    for c in cells:  # the dead agent's engine ran in its own session: end it
        if c.get("engine_pid"):
            try:
                os.kill(c["engine_pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    run_dir, rc, out = faulted_run(tmp_path, "agent:command:3", resume=True)
    assert rc == 0, out[-4000:]
    rep = report(run_dir)
    assert rep["version"] == 2
    assert sorted(steps_closed(run_dir)) == [0, 1]  # each step once, across the two jobs
    check_ledger(run_dir)
